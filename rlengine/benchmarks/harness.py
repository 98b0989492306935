"""Shared benchmark harness: timing, sweeps, rates against ceilings, tables, JSON and plots.

Every micro-benchmark (rlengine/benchmarks/micro/, `rlengine bench NAME`, or the scripts in bench/) times its providers with `measure()`, collects rows, and calls
`report()`, which prints an aligned table and writes JSON whose "conditions" are
rlengine.telemetry.provenance (commit, dirty flag, device, versions) plus the script's own.
Timing on a GPU follows triton.testing.do_bench: warm-up, an L2 flush (a 256 MB write) before
every call, one CUDA event pair per call read after a single sync, repetitions until about
`rep_ms` of kernel time; `cuda_graph=True` times replays of a graph of `graph_calls` calls
instead (for launch-bound kernels). On a CPU: perf_counter around each call, no flush (the
scripts that care use rings of cold buffers). Median and spread (p10/p90) are reported, never
the best run. Sweeps come from the command line (`--grid "B=1,8 L=128,1024"`), `--shape` runs
one point and `--ncu` brackets one launch per provider with cudaProfilerStart/Stop for
`ncu --profile-from-start off`. Rates: `rates()` gives GB/s and TFLOP/s and their fractions of
measured ceilings (`rlengine bench ceilings`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from rlengine.benchmarks.report import format_table  # noqa: F401  (one table format for every benchmark)
from rlengine.telemetry.provenance import provenance, write_json

L2_FLUSH_BYTES = 256 * 2**20  # larger than any current L2 (H100/H200: 50 MB), as do_bench uses


def conditions(device: torch.device | str | None = None, **extra) -> dict:
    """Machine, versions, commit and dirty flag: recorded with every benchmark number."""
    return provenance(device, **extra)


def _stats(times: list[float]) -> dict:
    times = sorted(times)
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"ms": statistics.median(times), "p10_ms": q(0.1), "p90_ms": q(0.9), "min_ms": times[0],
            "max_ms": times[-1], "iters": len(times)}


def event_times(fn: Callable[[], object], n: int, *, event=None, flush: Callable[[], object] | None = None,
                sync: Callable[[], object] | None = None) -> list[float]:
    """Milliseconds of n calls, one (start, end) event pair each, flushed before each, read after one sync.

    event: class with record() / elapsed_time(other) (torch.cuda.Event, or a CPU stand-in in tests).
    """
    event = event or (lambda: torch.cuda.Event(enable_timing=True))
    starts, ends = [event() for _ in range(n)], [event() for _ in range(n)]
    for s, e in zip(starts, ends):
        if flush is not None:
            flush()  # outside the timed pair, like do_bench's cache.zero_()
        s.record()
        fn()
        e.record()
    (sync or torch.cuda.synchronize)()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _call_refusing_host_sync(fn: Callable[[], object]) -> None:
    """fn() once with torch's sync check set to raise: a host sync fails here, before a capture starts. A capture
    that fails midway leaves the process's CUDA generator marked as capturing (torch 2.11 on an H200: every later
    torch.randn on the device raised "Offset increment outside graph capture")."""
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def _graph_times(fn: Callable[[], object], calls: int, reps: int) -> list[float]:
    """Per-call ms from `reps` replays of one CUDA graph holding `calls` calls of fn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _call_refusing_host_sync(fn)  # warm-up on the capture stream: lazy init must not happen inside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return [t / calls for t in event_times(graph.replay, reps)]


def measure(fn: Callable[[], object], *, warmup: int = 3, iters: int = 10, device: torch.device | str | None = None,
            flush_l2: bool = True, rep_ms: float | None = 100.0, cuda_graph: bool = False,
            graph_calls: int = 20) -> dict:
    """Time fn() after `warmup` calls; returns median/p10/p90/min/max ms, iters and the method used.

    GPU: `iters` is a minimum, raised until the calls sum to about rep_ms (at most 1000);
    flush_l2 writes 256 MB before every call; cuda_graph times graph replays (falls back to
    events, saying why, when capture fails). CPU: exactly `iters` perf_counter timings.
    """
    device = torch.device(device or "cpu")
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        note = "perf_counter" + (" (cuda_graph: no CUDA device)" if cuda_graph else "")
        return {**_stats(times), "method": note, "l2_flush": False}
    if cuda_graph:
        try:
            return {**_stats(_graph_times(fn, graph_calls, max(iters, 10))), "method": f"cuda-graph x{graph_calls}",
                    "l2_flush": False}
        except RuntimeError as exc:  # not capturable (host sync, allocation on a side stream, ...)
            fallback = f"cuda-events (graph capture failed: {str(exc).splitlines()[0][:120]})"
        torch.cuda.synchronize()
    else:
        fallback = "cuda-events"
    buf = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device) if flush_l2 else None
    flush = buf.zero_ if buf is not None else None
    n = iters
    if rep_ms:
        est = statistics.median(event_times(fn, 5, flush=flush))
        n = min(1000, max(iters, int(rep_ms / max(est, 1e-3))))
    return {**_stats(event_times(fn, n, flush=flush)), "method": fallback, "l2_flush": bool(flush_l2)}


def one_launch(fn: Callable[[], object], *, label: str, warmup: int = 3, device=None) -> str:
    """Warm up, then run fn once between cudaProfilerStart/Stop inside an NVTX range `label` (for ncu/nsys).

    Returns what happened, in words; on a CPU fn just runs once.
    """
    device = torch.device(device or "cpu")
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        fn()
        return f"{label}: ran once on {device}; nothing for ncu to capture without a CUDA device"
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    torch.cuda.nvtx.range_push(label)
    fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return f"{label}: one launch between cudaProfilerStart/Stop (ncu --profile-from-start off --nvtx)"


def rates(ms: float, *, nbytes: float | None = None, flops: float | None = None,
          ceilings: dict | None = None, dtype: str | None = None) -> dict:
    """GB/s and TFLOP/s of one call of `ms`, and their fractions of `ceilings` (a ceilings.json's
    "ceilings": bandwidth_bytes_per_s, flops_per_s[dtype])."""
    out = {}
    if nbytes is not None:
        out["GBps"] = nbytes / (ms * 1e-3) / 1e9
        if ceilings and ceilings.get("bandwidth_bytes_per_s"):
            out["bw_frac"] = nbytes / (ms * 1e-3) / ceilings["bandwidth_bytes_per_s"]
    if flops is not None:
        out["TFLOPs"] = flops / (ms * 1e-3) / 1e12
        peak = (ceilings or {}).get("flops_per_s", {})
        peak = peak.get(dtype) or (max(peak.values()) if peak else None)
        if peak:
            out["flops_frac"] = flops / (ms * 1e-3) / peak
    return out


def load_ceilings(path: str | Path | None) -> dict | None:
    """The "ceilings" of a ceilings.json written by `rlengine bench ceilings`, or None."""
    return json.loads(Path(path).read_text())["ceilings"] if path else None


# ---- declarative sweeps ----------------------------------------------------------------------
def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_grid(text: str) -> list[dict]:
    """'B=1,8 L=128,1024' -> the cartesian product [{B: 1, L: 128}, {B: 1, L: 1024}, ...] in order."""
    axes = []
    for part in text.replace(";", " ").split():
        name, sep, values = part.partition("=")
        if not sep or not name or not values:
            raise ValueError(f"a sweep axis is NAME=V1,V2,..., got {part!r} in {text!r}")
        axes.append((name, [_value(v) for v in values.split(",") if v]))
    if not axes:
        raise ValueError(f"empty sweep grid {text!r}")
    names = [a for a, _ in axes]
    return [dict(zip(names, combo)) for combo in itertools.product(*(v for _, v in axes))]


def add_sweep_args(p: argparse.ArgumentParser, grid: str, providers: list[str]) -> None:
    """--grid / --shape / --providers / --ncu / --plot / --ceilings / --out, the same in every script."""
    p.add_argument("--grid", default=grid, help=f"sweep axes, e.g. {grid!r} (cartesian product)")
    p.add_argument("--shape", default=None, help="one point of the grid, e.g. 'B=1 L=1024' (overrides --grid)")
    p.add_argument("--providers", default=",".join(providers), help=f"comma-separated subset of {providers}")
    p.add_argument("--ncu", action="store_true",
                   help="one launch per provider and shape between cudaProfilerStart/Stop, no timing "
                        "(ncu --profile-from-start off python bench/... --shape ... --ncu)")
    p.add_argument("--plot", default=None, metavar="PNG", help="also plot the sweep (tools/plots.py sweep)")
    p.add_argument("--ceilings", default=None, help="ceilings.json for fractions of measured bandwidth / FLOP/s")
    p.add_argument("--out", default=None, help="output folder for the JSON (default bench/results)")


def sweep_cases(args: argparse.Namespace) -> list[dict]:
    return parse_grid(args.shape) if args.shape else parse_grid(args.grid)


def selected_providers(args: argparse.Namespace, known: list[str]) -> list[str]:
    chosen = [x for x in args.providers.split(",") if x]
    bad = [x for x in chosen if x not in known]
    if bad:
        raise SystemExit(f"unknown provider(s) {bad}; choose from {known}")
    return chosen


# ---- output ----------------------------------------------------------------------------------
def peak_memory_mb(device: torch.device | str) -> float | None:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return None


def plot_sweep(path: str | Path, rows: list[dict], *, x: str, y: list[str], group: list[str] | None = None) -> Path:
    """rlengine.plots.measurements' sweep plot of `rows` (matplotlib: the plot extra)."""
    from rlengine.plots import require_matplotlib

    require_matplotlib()
    from rlengine.plots.measurements import plot_sweep as draw

    return draw({"rows": rows}, path, x=x, y=y, group=group)


def report(name: str, rows: list[dict], *, out: str | Path | None = None, columns: list[str] | None = None,
           extra: dict | None = None, device=None, plot: dict | None = None) -> Path:
    """Print the table and write {name}.json (rows + conditions) under `out` (default bench/results).

    plot: {"path": PNG, "x": column, "y": [columns], "group": [columns]} also draws the sweep.
    """
    print(format_table(rows, columns))
    out_dir = Path(out) if out else Path("bench") / "results"  # under the current directory
    path = write_json(out_dir / f"{name}.json", {"name": name, "rows": rows, **(extra or {})}, device=device)
    print(f"wrote {path}")
    if plot and plot.get("path"):
        print(f"wrote {plot_sweep(plot['path'], rows, x=plot['x'], y=plot['y'], group=plot.get('group'))}")
    return path
