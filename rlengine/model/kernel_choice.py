"""Kernel choice by measurement: which implementation of a CPU op runs, decided on this machine.

The CPU decode path has more than one implementation of its projections: torch's linear (oneDNN /
MKL), the C++ skinny linear (csrc/skinny_linear.cpp, a weight-streaming GEMV for <= 8 rows), and,
for bf16 weights, an fp32 GEMM over V-chunks of the upcast weight ("upcast"); LoRA's second GEMM
(y + s t B^T) runs as the chosen linear plus an add, or as csrc/lora_expand.cpp ("expand"). Which is fastest
depends on the CPU (AMX, AVX-512 bf16, bandwidth) and the row count; a rule tuned on one machine
is slow on the next. So each (op, dtype, rows class, weight shape) is timed once, at first use,
on its real inputs: every candidate alternately, a few rounds, medians compared. A candidate other
than torch's needs a clear win (MARGIN) so that noise does not flip choices between runs.

KernelChoices.mode:
  "measure"  time at first use (the default); the table can be saved, loaded and pinned
  "torch"    torch's ops everywhere (the reference: no measurement, reproducible anywhere)
  "skinny"   the skinny kernel wherever it applies (the old fixed rule), torch elsewhere
  "pinned"   only the loaded table's choices; a shape class missing from it raises
With mode "measure" and a cache_dir the table is also read from and written to a JSON file keyed
by the CPU model and flags, the torch and rlengine versions and the extension's build, so processes on
one machine agree.
Rows are the one free dimension of decode: 1-8 one class each, then powers of two.
The table is per process (like a GEMM library's heuristics), recorded in every provenance block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

import torch

MODES = ("measure", "torch", "skinny", "pinned")
MARGIN = 0.9          # a non-torch candidate must take <= 0.9x torch's median to be chosen
# ... except a split of torch's own op: "chunked" runs torch's GEMM on blocks of the weight's rows, each
# output element the same library dot product over K (bit-identical to the one call on a 2-core EPYC,
# fp32 and bf16, 64-512 rows), so a near tie flipping between runs changes time, not numbers. The 0.9
# bar kept qwen3-0.6b's fused q/k/v and gate/up GEMMs on the one call at 0.92-0.95x its time.
MARGINS = {"chunked": 0.97}
MIN_ROUNDS, MAX_ROUNDS = 3, 7
ROUND_BUDGET_S = 0.25  # stop adding rounds once the timing has taken this long (big LM heads)
TIMING = "cold-weights"  # how candidates are timed (ops.py: weights streamed from memory); part of the cache key


def rows_class(rows: int) -> str:
    """1..8 exactly, then the next power of two (16, 32, 64, ...)."""
    if rows <= 8:
        return str(rows)
    return str(1 << (rows - 1).bit_length())


def shape_key(op: str, dtype: torch.dtype, rows: int, weight_shape: tuple[int, ...]) -> str:
    """E.g. "linear/bfloat16/B=4/3072x1024" (the weight is [N, K])."""
    return f"{op}/{str(dtype).removeprefix('torch.')}/B={rows_class(rows)}/{'x'.join(map(str, weight_shape))}"


@dataclasses.dataclass(slots=True)
class Decision:
    """One shape class's choice and the medians that made it."""

    impl: str                                              # the candidate that runs
    ms: dict[str, float] = dataclasses.field(default_factory=dict)  # median ms per candidate (empty if pinned)
    source: str = "measured"                               # measured | cache | pinned | rule


def _median_times(candidates: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median wall ms of each candidate, rounds alternating between them after one warm-up call each."""
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():
        fn()
    start = time.perf_counter()
    for rounds in range(1, MAX_ROUNDS + 1):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e3)
        if rounds >= MIN_ROUNDS and time.perf_counter() - start > ROUND_BUDGET_S:
            break
    return {name: statistics.median(v) for name, v in samples.items()}


def pick(ms: dict[str, float], reference: str = "torch") -> str:
    """The fastest candidate, unless it beats the reference by less than its margin (MARGINS, else
    MARGIN; then the reference)."""
    best = min(ms, key=ms.get)
    if best != reference and reference in ms and ms[best] > MARGINS.get(best, MARGIN) * ms[reference]:
        return reference
    return best


def machine_key() -> dict:
    """What the cache is keyed by: CPU model and flags, torch and rlengine versions, the C++ extension's
    build, threads, timing method (a table timed another way, or of other kernels, is not reused)."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from rlengine import __version__
    from rlengine.model import ext as _ext
    return {"cpu": model, "ext_build": _ext.build_id(), "flags_sha1": hashlib.sha1(flags.encode()).hexdigest()[:12],
            "torch": torch.__version__, "rlengine": __version__, "threads": torch.get_num_threads(),
            "timing": TIMING}


class KernelChoices:
    """The per-process table of kernel choices; see the module docstring."""

    def __init__(self, mode: str = "measure", *, cache_dir: str | os.PathLike | None = None,
                 timer: Callable[[dict[str, Callable[[], object]]], dict[str, float]] = _median_times):
        self.table: dict[str, Decision] = {}
        self.memo: dict[tuple, str] = {}  # (op, dtype, rows, weight shape) -> impl: the per-call fast path
        self.timer = timer  # tests inject fixed timings
        self.configure(mode, cache_dir=cache_dir)

    def configure(self, mode: str, *, cache_dir: str | os.PathLike | None = None,
                  table: dict | None = None) -> None:
        """Switch mode; `table` ({key: impl or {"impl": ...}}) pins those choices, as a saved table does."""
        if mode not in MODES:
            raise ValueError(f"kernel choice mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.cache_dir = mode, Path(cache_dir) if cache_dir else None
        self.table, self.memo = {}, {}
        if table is not None:
            self.load(table, source="pinned")
        if self.cache_dir is not None and mode == "measure":
            path = self.cache_path()
            if path.exists():
                self.load(json.loads(path.read_text())["table"], source="cache")

    def cache_path(self) -> Path:
        key = json.dumps(machine_key(), sort_keys=True)
        return self.cache_dir / f"kernel_choice-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"

    def load(self, table: dict, *, source: str = "pinned") -> None:
        for key, entry in table.items():
            impl = entry if isinstance(entry, str) else entry["impl"]
            ms = {} if isinstance(entry, str) else dict(entry.get("ms", {}))
            self.table[key] = Decision(impl, ms, source)

    def to_dict(self) -> dict:
        return {key: dataclasses.asdict(d) for key, d in sorted(self.table.items())}

    def save(self, path: str | os.PathLike) -> Path:
        """Write {machine, table}, merged into what the file holds (its entries win, so processes sharing
        a cache file agree on the first decision, except where ours timed more candidates: a kernel
        added since), atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(path.with_suffix(".lock")):  # read-merge-write: a racing writer must not drop ours
            table = self.to_dict()
            for key, theirs in _read_table(path).items():
                timed = set(theirs.get("ms", {})) if isinstance(theirs, dict) else set()
                if key not in table or not timed < set(table[key]["ms"]):
                    table[key] = theirs
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"machine": machine_key(), "mode": self.mode, "table": table}, indent=1))
            os.replace(tmp, path)
        return path

    def choose(self, key: str, candidates: dict[str, Callable[[], object]], *, rule: str) -> str:
        """The implementation for shape class `key`. candidates: name -> a call on the real inputs
        (only names that can run these inputs); rule: the "skinny" mode's choice among them."""
        decision = self.table.get(key)
        # a cached decision is reused only if it timed every candidate there is now (a kernel added
        # since is measured too); pinned and this process's own decisions always are
        if decision is not None and decision.impl in candidates and (
                decision.source != "cache" or set(candidates) <= set(decision.ms)):
            return decision.impl
        if self.mode == "torch":
            return "torch"
        if self.mode == "skinny":
            return rule
        if self.mode == "pinned":
            have = decision.impl if decision else "nothing"
            raise RuntimeError(f"kernel choice is pinned and its table has {have} runnable for {key} "
                               f"(candidates: {', '.join(candidates)}); pin a table that covers this shape")
        if self.cache_dir is not None:  # another process on this machine may have decided it meanwhile
            self.load({k: v for k, v in _read_table(self.cache_path()).items() if k == key}, source="cache")
            cached = self.table.get(key)
            if cached is not None and cached.impl in candidates and set(candidates) <= set(cached.ms or ()):
                return cached.impl
        ms = self.timer(candidates) if len(candidates) > 1 else {name: 0.0 for name in candidates}
        self.table[key] = Decision(pick(ms), ms, "measured")
        if self.cache_dir is not None:
            self.save(self.cache_path())
            theirs = _read_table(self.cache_path()).get(key)
            if theirs is not None:  # a racing writer's wins
                self.load({key: theirs}, source="cache")
        return self.table[key].impl

    def summary(self) -> dict:
        """For provenance blocks: the mode and every decision so far."""
        return {"mode": self.mode, "cache": str(self.cache_path()) if self.cache_dir else None,
                "table": self.to_dict()}


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive advisory lock on lock_path (POSIX flock; a no-op where there is none)."""
    with open(lock_path, "a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


def _read_table(path: Path) -> dict:
    try:
        return json.loads(path.read_text())["table"]
    except (OSError, ValueError, KeyError):
        return {}


def default_cache_dir() -> Path:
    """~/.cache/rlengine, where `cpu_kernels="cache"` keeps its table."""
    return Path.home() / ".cache" / "rlengine"


def configure_from_setting(choices: KernelChoices, setting: str) -> None:
    """The user-facing setting (LLM(cpu_kernels=...), gen.cpu_kernels): "measure", "cache" (measure,
    and keep the table in default_cache_dir()), "torch", "skinny", or the path of a saved table
    (pinned: a reproducible run)."""
    if setting in ("measure", "torch", "skinny"):
        choices.configure(setting)
    elif setting == "cache":
        choices.configure("measure", cache_dir=default_cache_dir())
    elif setting.endswith(".json"):
        path = Path(setting)
        if not path.is_file():
            raise ValueError(f"cpu_kernels: no kernel-choice table at {path} (save one with "
                             "`rlengine info --kernels --save PATH`)")
        choices.configure("pinned", table=json.loads(path.read_text())["table"])
    else:
        raise ValueError(f"cpu_kernels must be measure, cache, torch, skinny or a saved table's .json path, "
                         f"got {setting!r}")


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """The [N, K] weights a decode step of model config `cfg` multiplies by (lm_head: the logits op)."""
    H, Hkv, D, C = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    shapes = {"qkv": ((H + 2 * Hkv) * D, C), "o": (C, H * D), "lm_head": (cfg.vocab_size, C)}
    if cfg.num_experts:
        shapes["router"] = (cfg.num_experts, C)
    else:
        shapes.update(gate_up=(2 * cfg.intermediate_size, C), down=(C, cfg.intermediate_size))
    return shapes

