"""Measured device ceilings for the roofline: sustained copy bandwidth and matmul FLOP/s.

W_HBM is taken from a large device-to-device tensor copy (bytes read + bytes written over the
median time) and F_eff from square matmuls per dtype (2*n^3 FLOPs over the median time). These
are what the hardware sustains through PyTorch, not datasheet peaks: the roofline built on them
says how close a decode step is to what this machine can actually do. On the CPU the sizes are
small so the whole measurement takes seconds. `run(device, out_dir)` is what
`rlengine bench ceilings` calls: it prints a table and writes ceilings.json.
"""

from __future__ import annotations

import contextlib
import json
import platform
import statistics
import time
from pathlib import Path

import torch

# (copy MiB, matmul n per dtype, repetitions): sized for ~1 s per item on a 2-core CPU.
_SIZES = {
    "cpu": (256, {torch.float32: 2048, torch.bfloat16: 1024}, 7),
    "cuda": (2048, {torch.bfloat16: 8192, torch.float32: 4096}, 10),
}


def _time(fn, device: torch.device, reps: int) -> float:
    """Median seconds of fn() after one warm-up call (CUDA events on GPU)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_bandwidth(device: torch.device, numel: int, reps: int) -> float:
    """Bytes read + written per second by dst.copy_(src) on fp32 tensors of `numel` elements."""
    src = torch.rand(numel, device=device)
    dst = torch.empty_like(src)
    return 2 * numel * 4 / _time(lambda: dst.copy_(src), device, reps)


def _matmul_flops(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    """FLOP/s of an n x n x n matmul (2*n^3 FLOPs) into a preallocated output."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _time(lambda: torch.mm(a, b, out=out), device, reps)


def measure_ceilings(device: torch.device | str = "cpu", *, reps: int | None = None) -> dict:
    """Copy bandwidth (bytes/s) and matmul FLOP/s per dtype on `device`.

    Returns {"device", "bandwidth_bytes_per_s", "copy_mib", "flops_per_s": {dtype: FLOP/s},
    "matmul_n": {dtype: n}, "allow_tf32", "reps"}. The fp32 GPU number follows the current
    torch.backends.cuda.matmul.allow_tf32 setting, which is recorded.
    """
    device = torch.device(device)
    if device.type not in _SIZES:
        raise ValueError(f"measure_ceilings: device type must be 'cpu' or 'cuda', got {device}")
    copy_mib, matmul_n, default_reps = _SIZES[device.type]
    reps = reps or default_reps
    numel = copy_mib * 2**20 // 4
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        bandwidth = _copy_bandwidth(device, numel, reps)  # events record on the current device's stream
        flops = {str(dtype).removeprefix("torch."): _matmul_flops(device, dtype, n, reps)
                 for dtype, n in matmul_n.items()}
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
        f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "bandwidth_bytes_per_s": bandwidth,
        "copy_mib": copy_mib,
        "flops_per_s": flops,
        "matmul_n": {str(k).removeprefix("torch."): v for k, v in matmul_n.items()},
        "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "reps": reps,
    }


def ceiling_rows(c: dict) -> list[dict]:
    """Table rows: one for the copy, one per matmul dtype."""
    rows = [{"kind": "copy", "dtype": "-", "size": f"{c['copy_mib']} MiB", "value": c["bandwidth_bytes_per_s"] / 1e9,
             "unit": "GB/s"}]
    for dtype, f in c["flops_per_s"].items():
        rows.append({"kind": "matmul", "dtype": dtype, "size": f"n={c['matmul_n'][dtype]}", "value": f / 1e12,
                     "unit": "TFLOP/s"})
    return rows


def format_ceilings(c: dict) -> str:
    """Plain-text table of a measure_ceilings() result."""
    lines = [f"device: {c['device']}", f"{'kind':<8}{'dtype':<10}{'size':<12}{'value':>10}  unit"]
    for r in ceiling_rows(c):
        lines.append(f"{r['kind']:<8}{r['dtype']:<10}{r['size']:<12}{r['value']:>10.3f}  {r['unit']}")
    return "\n".join(lines)


def run(device: torch.device | str = "cpu", out_dir: str | Path = "bench/results", *,
        reps: int | None = None) -> Path:
    """Measure, print the table, write {out_dir}/ceilings.json; returns the JSON path."""
    c = measure_ceilings(device, reps=reps)
    print(format_ceilings(c))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ceilings.json"
    payload = {"name": "ceilings", "conditions": {"time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                                  "torch": torch.__version__, "device": str(device)},
               "ceilings": c, "rows": ceiling_rows(c)}
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
    return path
