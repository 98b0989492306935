"""Provenance of a measurement: which code, on which machine, with which engine settings.

Every benchmark JSON (rlengine/benchmarks/harness.py, `rlengine bench ...`) embeds `provenance()` under
"conditions", so a number in docs/RESULTS.md can be traced to a commit, whether the tree had
uncommitted edits (and a hash of them), the device, the library versions and, for engine
benchmarks, the attention backend and CUDA-graph state the engine actually ran with (not the
one asked for). `write_json` is the one place results are written, so nobody forgets it.
Simplification: the commit is read with `git` from the package's own checkout; an installed
(non-editable) package has no checkout and records commit None.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

_REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=_REPO, check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state() -> dict:
    """commit (full), commit_short, dirty (tracked files differ from HEAD) and dirty_diff_sha1 (hash of
    `git diff HEAD`, so two dirty runs can be told apart). All None outside a git checkout."""
    head = _git("rev-parse", "HEAD")
    if not head:
        return {"commit": None, "commit_short": None, "dirty": None, "dirty_diff_sha1": None}
    diff = _git("diff", "HEAD") or ""
    return {"commit": head.strip(), "commit_short": head.strip()[:7], "dirty": bool(diff),
            "dirty_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None}


def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers", "flashinfer", "pynvml"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "installed")
        except ImportError:
            out[name] = None
    return out


def device_info(device: torch.device | str | None = None) -> dict:
    """The device a measurement ran on: name, CUDA version, clocks-relevant facts where known."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    info = {"device": str(device), "cpu": platform.processor() or platform.machine(), "cpu_model": cpu_model(),
            "cpu_isa": cpu_isa(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            # other processes' load when the JSON was written: a loaded host makes every number slower
            "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    sm_count=props.multi_processor_count, cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
    return info


def engine_state(llm) -> dict:
    """The attention backend, CUDA-graph state and CPU kernel choices an LLM actually runs with."""
    graphs = getattr(getattr(llm, "runner", None), "graphs", None)
    return {"attention_backend": llm.attention_backend,
            "cuda_graphs": "on" if llm.cuda_graphs_off is None else f"off: {llm.cuda_graphs_off}",
            "cuda_graph_buckets": list(getattr(graphs, "sizes", []) or []) or None,
            "cpu_kernels": llm.cpu_kernels() if hasattr(llm, "cpu_kernels") else None}


def provenance(device: torch.device | str | None = None, *, llm=None, **extra) -> dict:
    """Everything recorded with every benchmark number (see the module docstring); `extra` is merged in."""
    info = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(), **git_state(), **_versions(),
            **device_info(device)}
    if llm is not None:
        info.update(engine_state(llm))
    info.update(extra)
    return info


@functools.cache
def cpu_model() -> str:
    """lscpu's "Model name" (platform.processor() when lscpu is missing): the CPU every number names."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "unknown")


@functools.cache
def cpu_isa() -> list[str]:
    """The CPU's flags that decide which CPU kernels win (AMX, AVX-512 bf16 / VNNI, AVX2): the same
    "Model name" ships with and without them."""
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), [])
    except OSError:
        return []
    return sorted(f for f in set(flags) if f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2"))


def write_json(path: str | Path, payload: dict, *, device=None, llm=None, **extra) -> Path:
    """Write `payload` as JSON with provenance merged into payload["conditions"] (payload wins on clashes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(payload)
    payload["conditions"] = {**provenance(device, llm=llm, **extra), **payload.get("conditions", {})}
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
