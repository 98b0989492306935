"""`rlengine tune --predict DEVICE`: the B_gen knee a job should show, from Eq. 5 and a device's ceilings.

    ceil = device_ceilings("H200")                     # or "cpu" (measured now), or a ceilings.json path
    p = predict_knee(model_cfg, ceil, context_len=48, weight_bytes=2, delta=0.1, b_max=4096)
Eq. 5 (docs/METHOD.md): t_dec(B) = max{(M_W + B m_u) / W, B f_tok / F}, q_tok(B) = B / t_dec(B).
q_tok rises with B while the weight stream M_W dominates and saturates at min(W / m_u, F / f_tok).
The predicted critical B is the paper's rule applied to that curve: the smallest B with q_tok(B)
>= (1 - delta) q_tok(b_max), b_max = B_KV or the cap given; the ridge B (t_mem = t_cmp) is reported
too. B_act is taken as B_gen (every in-flight sequence decodes each step), which holds while
responses have similar lengths. Named devices use datasheet peaks (dense bf16), so their knee is
an upper estimate of what a real engine sustains; `cpu` and a JSON file use measured ceilings
(`rlengine bench ceilings`). With measured step costs (tune/step_costs.py: the engine's fixed and
per-sequence decode cost d0 + d1 B as a floor under Eq. 5's t_dec, and the learner's time per response)
the knee is also given for end-to-end q, the quantity stage 2 measures:
q(B) = 1 / (L x max(d0 + d1 B, t_dec(B)) / B + t_train).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from rlengine.analysis.roofline import decode_roofline
from rlengine.model.config import ConfigError, ModelConfig

# datasheet peaks (SXM): HBM bandwidth in bytes/s, dense bf16 FLOP/s
NAMED = {"H100": {"bandwidth_bytes_per_s": 3.35e12, "flops_per_s": {"bfloat16": 989e12, "float32": 67e12},
                  "device": "H100 SXM (datasheet)"},
         "H200": {"bandwidth_bytes_per_s": 4.8e12, "flops_per_s": {"bfloat16": 989e12, "float32": 67e12},
                  "device": "H200 SXM (datasheet)"}}


@dataclass(frozen=True, slots=True, kw_only=True)
class KneePrediction:
    device: str
    bandwidth: float              # W, bytes/s
    flops: float                  # F, FLOP/s for the job's dtype
    context_len: int              # S used for m_u and f_tok
    weight_bytes: float           # M_W at B = 1
    seq_bytes: float              # m_u
    flops_per_token: float        # f_tok
    ridge_b: float                # B where t_mem = t_cmp (inf when the step never turns compute-bound)
    critical_b: int               # smallest B with q_tok >= (1 - delta) q_tok(b_max)
    q_tok_max: float              # q_tok at b_max, tokens/s
    b_max: int
    delta: float
    costs: dict | None = None     # StepCosts as a dict, when measured
    critical_b_q: int = 0         # with costs: smallest B with q >= (1 - delta) q(b_max)
    q_max: float = 0.0            # with costs: q(b_max), responses/s


def device_ceilings(device: str) -> dict:
    """Ceilings dict (bandwidth_bytes_per_s, flops_per_s {dtype: FLOP/s}, device) of a named GPU, of
    this machine's CPU (measured now, one thread as the tune runs), or of a ceilings.json file."""
    if device.upper() in NAMED:
        return NAMED[device.upper()]
    if device == "cpu":
        import torch

        from rlengine.analysis.ceilings import measure_ceilings

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return measure_ceilings("cpu")
        finally:
            torch.set_num_threads(threads)
    path = Path(device)
    if not path.is_file():
        raise ConfigError(f"--predict {device!r}: not H100, H200, cpu or a ceilings JSON file "
                          f"(`rlengine bench ceilings` writes one)")
    d = json.loads(path.read_text())
    d = d.get("ceilings", d)
    if "bandwidth_bytes_per_s" not in d or "flops_per_s" not in d:
        raise ConfigError(f"--predict {device}: the JSON has no bandwidth_bytes_per_s / flops_per_s")
    return d


def _smallest_b(rate, bar: float, b_max: int) -> int:
    """Smallest B in [1, b_max] with rate(B) >= bar, for a rate nondecreasing in B (bisection)."""
    lo, hi = 1, b_max
    while lo < hi:
        mid = (lo + hi) // 2
        if rate(mid) >= bar:
            hi = mid
        else:
            lo = mid + 1
    return lo


def predict_knee(cfg: ModelConfig, ceilings: dict, *, context_len: int, dtype: str = "bfloat16",
                 delta: float = 0.1, b_max: int = 4096, costs=None) -> KneePrediction:
    """Eq. 5's critical B for a model on a device (see the module docstring); with `costs` (a StepCosts)
    also the critical B of end-to-end q."""
    if not 0 < delta < 1 or b_max < 1 or context_len < 1:
        raise ValueError(f"predict_knee needs 0 < delta < 1, b_max >= 1, context_len >= 1; got {delta}, {b_max}, "
                         f"{context_len}")
    flops = ceilings["flops_per_s"].get(dtype) or ceilings["flops_per_s"].get("float32")
    if not flops:
        raise ConfigError(f"--predict: the ceilings give no FLOP/s for {dtype}")
    w = float(ceilings["bandwidth_bytes_per_s"])
    nbytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 2)

    def step(b):
        return decode_roofline(cfg, b_act=b, context_len=context_len, bandwidth=w, flops=flops,
                               weight_bytes=nbytes, kv_bytes=nbytes)

    one, two, top = step(1), step(2), step(b_max)
    lo = _smallest_b(lambda b: step(b).tokens_per_s, (1 - delta) * top.tokens_per_s, b_max)
    extra = {}
    if costs is not None:
        def q(b):  # responses/s: L decode steps of B sequences, then t_train per response
            t_dec = max(costs.d0 + costs.d1 * b, step(b).t_dec)
            return 1.0 / (costs.response_len * t_dec / b + costs.train_per_response)

        q_top = q(b_max)
        extra = dict(costs=dataclasses.asdict(costs), critical_b_q=_smallest_b(q, (1 - delta) * q_top, b_max),
                     q_max=q_top)
    row = two.weight_bytes - one.weight_bytes      # weight bytes that grow with B (embedding rows looked up)
    per_seq = one.seq_bytes + row
    slope = one.flops_per_token / flops - per_seq / w  # t_cmp - t_mem grows by this per sequence
    ridge = (one.weight_bytes - row) / w / slope if slope > 0 else float("inf")
    return KneePrediction(device=str(ceilings.get("device", "?")), bandwidth=w, flops=flops, context_len=context_len,
                          weight_bytes=one.weight_bytes, seq_bytes=one.seq_bytes,
                          flops_per_token=one.flops_per_token, ridge_b=ridge, critical_b=lo,
                          q_tok_max=top.tokens_per_s, b_max=b_max, delta=delta, **extra)


def job_model_config(job: dict) -> ModelConfig:
    """The job's ModelConfig: model.name as the job names it (preset, directory or hub id at model.revision)."""
    from rlengine.model.factory import model_config

    return model_config(job["model"]["name"], revision=job["model"].get("revision") or None)


def format_prediction(p: KneePrediction, b_train: int) -> str:
    ridge = "never (bandwidth-bound at every B)" if p.ridge_b == float("inf") else f"{p.ridge_b:.0f}"
    return (f"predicted B_gen knee on {p.device}: critical B_gen {p.critical_b} (smallest B with q_tok >= "
            f"(1 - {p.delta}) q_tok({p.b_max}) = {(1 - p.delta) * p.q_tok_max:.4g} tok/s); ridge B {ridge}; "
            f"B_train {b_train} -> {p.critical_b / b_train:.2g} x B_train\n"
            f"  W = {p.bandwidth / 1e9:.1f} GB/s, F = {p.flops / 1e12:.3f} TFLOP/s, S = {p.context_len}, "
            f"M_W = {p.weight_bytes / 1e6:.2f} MB, m_u = {p.seq_bytes / 1e3:.1f} kB, "
            f"f_tok = {p.flops_per_token / 1e6:.2f} MFLOP" + (_format_costs(p, b_train) if p.costs else ""))


def _format_costs(p: KneePrediction, b_train: int) -> str:
    c = p.costs
    return (f"\nwith this machine's measured step costs: critical B_gen {p.critical_b_q} for end-to-end q "
            f"(q >= (1 - {p.delta}) q({p.b_max}) = {(1 - p.delta) * p.q_max:.4g} responses/s); "
            f"{p.critical_b_q / b_train:.2g} x B_train\n"
            f"  decode step d0 + d1 B: d0 = {c['d0'] * 1e3:.3f} ms, d1 = {c['d1'] * 1e6:.2f} us/seq "
            f"(steps {c['step_s'][0] * 1e3:.3f} / {c['step_s'][1] * 1e3:.3f} ms at B {c['batches'][0]} / "
            f"{c['batches'][1]}); learner {c['train_per_response'] * 1e3:.3f} ms/response; L = {c['response_len']}")
