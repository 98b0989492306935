"""A modelled cost table (`rlengine bench costs --modelled`): step costs of a model on a GPU it has not run on.

    table = modelled_cost_table("qwen3-0.6b", "bfloat16", "H200")   # a CostTable with kind = "modelled"

Every step is Eq. 5 (docs/METHOD.md, rlengine.analysis.roofline) plus a launch floor:

    decode(B, S)   = max{(M_W(B) + B m_u(S)) / W, B f_tok(S) / F}                      + launches x 2.5 us
    prefill(T)     = max{M_W(1) / W, (2 P_act T + 2 L H D T^2) / F}                    + launches x 2.5 us
    learner(T)     = max{3 M_W(1) / W, 3 (2 P_act T + 4 L H D T s / 2) / F}            + 3 launches x 2.5 us
    optimizer      = P (24 + 2 s_w) bytes / W (AdamW over fp32 masters: grads, masters, m, v, weights)  + 17 launches

launches = 11 per decoder layer + 17 per step, the count of a decode step's kernels from reading the
engine's forward (norms, q/k/v and o projections, q/k norms with RoPE, the KV write, attention, the
residual adds and the MLP's three projections and activation per layer; embedding, final norm, LM head
and the sampler's kernels per step); no launch counter exists yet. 2.5 us is a launch's cost when the
kernels are too short to hide it. Prefill attention is counted as one causal sequence of T tokens (an
upper bound for several shorter prompts); the learner's packed sequences as s = 512 tokens each, and its
backward as twice the forward (3x in all), reading the weights three times.

Ceilings: H200 from the first GPU run's `rlengine bench ceilings` (docs/results/gpu_h200/ceilings.json:
copy 4203 GB/s, bf16 matmul 780 TFLOP/s, fp32 50.6 TFLOP/s). H100 (SXM): the same compute die and clocks
as the H200, so the same FLOP/s, and the H200's measured bandwidth scaled by the datasheet ratio
3.35 / 4.8 TB/s (2933 GB/s): H100 figures that were modelled, not measured on an H100.
Everything is a lower bound on a real engine (no host work, no kernel inefficiency): a modelled table
says so in its `kind`, and every figure made with it names it modelled.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlengine.analysis.cost_table import CostTable
from rlengine.analysis.roofline import decode_roofline, param_counts, weight_bytes_per_step
from rlengine.model.config import ConfigError, ModelConfig

H200_MEASURED = {"bandwidth": 4203170159291.1157, "flops": {"bfloat16": 780193876393766.5, "float16": 780193876393766.5,
                                                            "float32": 50578117171235.51}}
CEILINGS = {
    "H200": {**H200_MEASURED, "source": "measured on one H200 (docs/results/gpu_h200/ceilings.json)"},
    "H100": {"bandwidth": H200_MEASURED["bandwidth"] * 3.35 / 4.8, "flops": H200_MEASURED["flops"],
             "source": "the H200's measured ceilings, bandwidth x 3.35/4.8 (datasheet HBM ratio), same FLOP/s "
                       "(same GH100 compute); not measured on an H100"},
}
LAUNCH_S = 2.5e-6
LAUNCHES_PER_LAYER, LAUNCHES_PER_STEP = 11, 17
LEARNER_SEQ = 512
DECODE_B = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
DECODE_CONTEXT = (16, 64, 256, 1024, 4096, 16384, 32768)
TOKENS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def model_config(model: str) -> ModelConfig:
    """A preset's ModelConfig, or a checkpoint directory's config.json."""
    from rlengine.model.config import PRESETS, preset

    if model in PRESETS:
        return preset(model)
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ConfigError(f"modelled costs: model {model!r} is neither a preset nor a directory with config.json")
    return ModelConfig.from_hf_dict(json.loads(path.read_text()), str(path))


def modelled_cost_table(model: str, dtype: str, device: str) -> CostTable:
    """The modelled CostTable of `model` in `dtype` on `device` (H100 | H200); see the module docstring."""
    if device.upper() not in CEILINGS:
        raise ConfigError(f"modelled costs: device must be one of {', '.join(CEILINGS)}, got {device!r}")
    if dtype not in BYTES:
        raise ConfigError(f"modelled costs: dtype must be one of {', '.join(BYTES)}, got {dtype!r}")
    ceil, cfg, s = CEILINGS[device.upper()], model_config(model), BYTES[dtype]
    w, f = ceil["bandwidth"], ceil["flops"][dtype]
    layers, heads, hd = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    floor = (LAUNCHES_PER_LAYER * layers + LAUNCHES_PER_STEP) * LAUNCH_S
    decode = tuple((b, c, decode_roofline(cfg, b_act=b, context_len=c, bandwidth=w, flops=f, weight_bytes=s,
                                          kv_bytes=s).t_dec + floor)
                   for b in DECODE_B for c in DECODE_CONTEXT)
    p = param_counts(cfg)
    m_w = weight_bytes_per_step(cfg, 1, s)
    prefill = tuple((t, max(m_w / w, (2 * p.active_matmul * t + 2 * layers * heads * hd * t * t) / f) + floor)
                    for t in TOKENS)
    fwd = lambda t: 2 * p.active_matmul * t + 4 * layers * heads * hd * t * min(t, LEARNER_SEQ) / 2  # noqa: E731
    learner = tuple((t, max(3 * m_w / w, 3 * fwd(t) / f) + 3 * floor) for t in TOKENS)
    optimizer_s = p.total * (24 + 2 * s) / w + LAUNCHES_PER_STEP * LAUNCH_S
    return CostTable(model=model, dtype=dtype, kind="modelled", decode=decode, prefill=prefill, learner=learner,
                     optimizer_s=optimizer_s,
                     provenance={"device": device.upper(), "method": "Eq. 5 + launch floor "
                                 "(rlengine/analysis/modelled_costs.py)", "ceilings_source": ceil["source"],
                                 "bandwidth_bytes_per_s": w, "flops_per_s": f, "launch_s": LAUNCH_S,
                                 "launches_per_step": LAUNCHES_PER_LAYER * layers + LAUNCHES_PER_STEP,
                                 "launch_count": f"{LAUNCHES_PER_LAYER} per layer + {LAUNCHES_PER_STEP} per step "
                                 "(from reading the engine's forward; no launch counter)",
                                 "learner_seq": LEARNER_SEQ})
