"""Shared benchmark harness: timing, conditions, tables and JSON output.

Every bench script in bench/ times its providers with `measure()`, collects rows, and calls
`report()`, which prints an aligned table and writes JSON with the conditions (device,
versions, commit, threads) next to every number. On GPU timing uses CUDA events after
warm-up; on CPU perf_counter. Median and spread (p10/p90) are reported, never the best run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch


def conditions(device: torch.device | str | None = None) -> dict:
    """Machine, versions and commit: recorded with every benchmark number."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    info = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=Path(__file__).parent, check=False).stdout.strip() or None
    except OSError:
        info["commit"] = None
    return info


def measure(fn: Callable[[], object], *, warmup: int = 3, iters: int = 10,
            device: torch.device | str | None = None) -> dict:
    """Time fn() `iters` times after `warmup` calls; returns median/p10/p90 in milliseconds."""
    device = torch.device(device or "cpu")
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"ms": statistics.median(times), "p10_ms": q(0.1), "p90_ms": q(0.9), "iters": iters}


def peak_memory_mb(device: torch.device | str) -> float | None:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return None


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Aligned plain-text table of dict rows (floats shown with 4 significant digits)."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))  # noqa: E731
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def report(name: str, rows: list[dict], *, out: str | Path | None = None, columns: list[str] | None = None,
           extra: dict | None = None, device=None) -> Path:
    """Print the table and write {name}.json (rows + conditions) under `out` (default bench/results)."""
    print(format_table(rows, columns))
    out_dir = Path(out) if out else Path(__file__).parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {"name": name, "conditions": conditions(device), "rows": rows, **(extra or {})}
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {path}")
    return path
