"""Benchmarks runnable as `rlengine bench NAME [args]`: each module has main(argv) -> int | None.

The engine and RL benchmarks are modules here; the kernel and host-overhead micro-benchmarks are in
micro/ over harness.py (bench/ holds their script forms for a checkout). MODULES names each one's module.
"""

BENCHMARKS = {
    "decode": "decode throughput, latency percentiles and energy per active batch and context, next to transformers",
    "serve": "requests arriving at a rate (Poisson): TTFT, TPOT, ITL, goodput (vLLM's definitions)",
    "ceilings": "this device's copy bandwidth and matmul FLOP/s (the roofline's W and F)",
    "asymmetry": "rollout collection and training time vs batch size; fits d0, d1, gamma",
    "job_ladder": "a job's throughput q over B_gen with the policy frozen (train.lr = 0): the asymmetry on a real job",
    "costs": "this device's step costs (decode by B_act and context, prefill, learner, optimizer) as a cost table",
    "paged_decode": "paged decode attention kernels (torch reference, C++, Triton): ms, GB/s vs the ceiling",
    "moe": "fused MoE forward and forward+backward against the reference loop over experts: time, TFLOP/s",
    "logprob": "fused LM-head log-prob (+ entropy, + backward) against full [T, V] logits",
    "packed_attention": "packed causal attention: one padded SDPA vs a per-sequence loop, forward and backward",
    "skinny_linear": "the C++ skinny linear (B_act = 1-4 rows) against torch's linear at decode shapes (CPU)",
    "host_overhead": "the engine's host-side work per decode step (schedule, prepare, postprocess), no forward",
    "batch_invariant": "batch-invariant mode against the default: decode step per B_act and learner step (CPU)",
    "decode_profile": "a CPU decode step's parts (projections, attention, norms, sampler, host) per B_act and dtype, "
                      "against the linear floor and transformers",
    "shared_prefix": "decode step time with and without shared-prefix (cascade) decode for GRPO groups (CPU)",
    "prefill": "a prefill forward (B prompts of S tokens) against transformers (sdpa), per dtype and length",
    "learner": "the learner step (packed forward + log-prob + masked loss + backward) against transformers (sdpa)",
}
MICRO = ("paged_decode", "moe", "logprob", "packed_attention", "skinny_linear", "host_overhead", "batch_invariant",
         "decode_profile", "shared_prefix")
MODULES = {name: f"rlengine.benchmarks.{'micro.' if name in MICRO else ''}{name}" for name in BENCHMARKS}
