"""Benchmarks runnable as `rlengine bench NAME [args]`: each module here has main(argv) -> int.

The scripts in bench/ (kernel microbenchmarks) use the same harness conventions; these are
the installed, user-facing ones.
"""

BENCHMARKS = {
    "decode": "decode throughput, latency percentiles and energy per active batch and context, next to transformers",
    "serve": "requests arriving at a rate (Poisson): TTFT, TPOT, ITL, goodput (vLLM's definitions)",
    "ceilings": "this device's copy bandwidth and matmul FLOP/s (the roofline's W and F)",
    "asymmetry": "rollout collection and training time vs batch size; fits d0, d1, gamma",
}
