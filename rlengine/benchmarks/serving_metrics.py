"""Serving metrics with vLLM benchmark_serving's definitions, from per-request token timestamps.

For each request: arrival time (when the client would have sent it), the time each output
token became available, and the input length. Then, as vLLM computes them:
  TTFT  first token time - arrival
  TPOT  (E2EL - TTFT) / (output tokens - 1), over requests with more than one output token
  ITL   every gap between consecutive tokens of a request, pooled over requests
  E2EL  last token time - arrival
  throughput: completed requests, output tokens and input + output tokens per second of the run
  goodput: requests per second that meet every given SLO (ttft / tpot / e2el, in ms)
Statistics are mean, median, std, p90 and p99 in milliseconds; percentiles interpolate
linearly between order statistics (numpy.percentile's default), so numbers are comparable.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(slots=True, kw_only=True)
class RequestTiming:
    """One request's timeline, in seconds since the start of the run."""

    arrival: float                                          # when the request was due (Poisson schedule)
    input_len: int                                          # prompt tokens
    token_times: list[float] = field(default_factory=list)  # when each output token was available


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, like numpy.percentile."""
    if not values:
        raise ValueError("percentile of an empty list")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _summary(name: str, seconds: list[float]) -> dict:
    ms = [1e3 * x for x in seconds]
    if not ms:
        return {f"{s}_{name}_ms": None for s in ("mean", "median", "std", "p90", "p99")}
    return {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": percentile(ms, 50),
            f"std_{name}_ms": statistics.pstdev(ms), f"p90_{name}_ms": percentile(ms, 90),
            f"p99_{name}_ms": percentile(ms, 99)}


def parse_slos(text: str | None) -> dict[str, float]:
    """'ttft:500 tpot:50' -> {"ttft": 500.0, "tpot": 50.0} (milliseconds), vLLM's --goodput syntax."""
    slos = {}
    for part in (text or "").split():
        name, sep, value = part.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"an SLO is NAME:MS with NAME in {SLO_METRICS}, got {part!r}")
        slos[name] = float(value)
    return slos


def serving_metrics(requests: list[RequestTiming], duration_s: float, slos: dict[str, float] | None = None) -> dict:
    """The metrics above over the completed requests (those with at least one token)."""
    if not duration_s > 0:
        raise ValueError(f"serving_metrics: duration must be > 0 s, got {duration_s!r}")
    done = [r for r in requests if r.token_times]
    ttft = [r.token_times[0] - r.arrival for r in done]
    e2el = [r.token_times[-1] - r.arrival for r in done]
    tpot = [(e - t) / (len(r.token_times) - 1) for r, t, e in zip(done, ttft, e2el) if len(r.token_times) > 1]
    itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    out_tokens = sum(len(r.token_times) for r in done)
    in_tokens = sum(r.input_len for r in done)
    good = 0
    for r, t, e in zip(done, ttft, e2el):
        per_tok = (e - t) / (len(r.token_times) - 1) if len(r.token_times) > 1 else 0.0
        values = {"ttft": t, "tpot": per_tok, "e2el": e}
        good += all(1e3 * values[k] <= v for k, v in (slos or {}).items())
    return {"completed": len(done), "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
            "duration_s": duration_s, "request_throughput": len(done) / duration_s,
            "output_throughput": out_tokens / duration_s,
            "total_token_throughput": (in_tokens + out_tokens) / duration_s,
            "request_goodput": good / duration_s if slos else None,
            **_summary("ttft", ttft), **_summary("tpot", tpot), **_summary("itl", itl), **_summary("e2el", e2el)}
