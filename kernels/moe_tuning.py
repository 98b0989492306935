"""Per-kernel tile choice for the sorted fused MoE path: a candidate list per kernel and shape class,
timed on the GPU at first use, the winner kept for the process.

Used by fused_moe.py (forward launches of the "sorted" variant) and fused_moe_bwd.py (its backward
launches). Key: (kernel, shape class by rows per expert, dtype, C, F, E, device name), so one
tuning serves every call of a layer shape whatever T within the class. Each candidate runs once
untimed (its compile) and `reps` times timed; the tuning of a process stops trying new candidates
once `budget_s` seconds of wall time are spent (the best so far wins). The candidates of the first
position are what runs untuned: under the interpreter, with a pinned config (tests), or on a class
without candidates (decode and small: there the call's shared tiles run). Every candidate is
compiled for sm_90 by the compile tier (tools/sm90/cases.py) and checked for spills.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from .moe_gemm import MoEConfig, Tiles, pin_config, shape_class
from .timing import cuda_seconds

_T = Tiles
# kernel -> shape class -> candidates, first = the untuned choice. Row-block kernels: (block_n,
# block_k) with the call's BLOCK_M; the weight gradient: block_p x block_n tiles, block_k rows a step.
CANDIDATES: dict[str, dict[str, tuple[Tiles, ...]]] = {
    "gate_up": {"medium": (_T(block_n=64, block_k=64), _T(block_n=128, block_k=64, num_warps=8)),
                "large": (_T(block_n=128, block_k=64, num_warps=8),
                          _T(block_n=128, block_k=64, num_warps=8, num_stages=4))},
    "down": {"medium": (_T(block_n=64, block_k=64), _T(block_n=128, block_k=64, num_warps=8)),
             "large": (_T(block_n=128, block_k=64, num_warps=8), _T(block_n=256, block_k=64, num_warps=8))},
    "down_bwd": {"medium": (_T(block_n=64, block_k=64), _T(block_n=128, block_k=64, num_warps=8)),
                 "large": (_T(block_n=128, block_k=64, num_warps=8), _T(block_n=64, block_k=64, num_stages=4))},
    "dx": {"medium": (_T(block_n=64, block_k=64), _T(block_n=128, block_k=64, num_warps=8)),
           "large": (_T(block_n=128, block_k=64, num_warps=8), _T(block_n=256, block_k=64, num_warps=8))},
    "wgrad": {"medium": (_T(block_p=64, block_n=64, block_k=64), _T(block_p=128, block_n=128, block_k=64, num_warps=8)),
              "large": (_T(block_p=128, block_n=128, block_k=64, num_warps=8),
                        _T(block_p=128, block_n=128, block_k=64, num_warps=8, num_stages=4),
                        _T(block_p=128, block_n=64, block_k=64, num_warps=4, num_stages=4))},
}


def candidates(kernel: str, cls: str, hidden: int, ffn: int) -> tuple[Tiles, ...]:
    """The candidates of `kernel` in shape class `cls`, tiles clipped to the model dims (() if none)."""
    small = max(16, 1 << (min(hidden, ffn) - 1).bit_length())
    return tuple(dict.fromkeys(t.clipped(small) for t in CANDIDATES.get(kernel, {}).get(cls, ())))


def with_tiles(cfg: MoEConfig, kernel: str, tiles: Tiles) -> MoEConfig:
    """cfg with `kernel`'s tiles replaced."""
    rest = tuple((k, t) for k, t in cfg.kernel_tiles if k != kernel)
    return dataclasses.replace(cfg, kernel_tiles=rest + ((kernel, tiles),))


@dataclasses.dataclass
class Tuner:
    """The process's tile choices: `choices` maps a key to the winning Tiles."""

    budget_s: float = 30.0
    reps: int = 3
    timer: Callable[[Callable[[], object], int], float] = cuda_seconds  # (fn, reps) -> seconds per run
    choices: dict = dataclasses.field(default_factory=dict)
    spent_s: float = 0.0
    log: list = dataclasses.field(default_factory=list)  # (key, tiles, seconds) per timed candidate

    def pick(self, key, cands: tuple[Tiles, ...], run: Callable[[Tiles], object]) -> Tiles:
        if key in self.choices:
            return self.choices[key]
        best, best_s = cands[0], float("inf")
        for tiles in cands:
            if self.spent_s >= self.budget_s and best_s < float("inf"):
                break  # out of tuning time: the best so far wins, the rest are never tried
            t0 = time.perf_counter()
            run(tiles)  # compile and warm up
            seconds = self.timer(lambda tiles=tiles: run(tiles), self.reps)
            self.spent_s += time.perf_counter() - t0
            self.log.append((key, tiles, seconds))
            if seconds < best_s:
                best, best_s = tiles, seconds
        self.choices[key] = best
        return best


TUNER = Tuner()


def tuned_launch(kernel: str, cfg: MoEConfig, dims: tuple, device: torch.device, dtype: torch.dtype,
                 run: Callable[[MoEConfig], object], *, tuner: Tuner | None = None):
    """run(cfg with `kernel`'s tiles chosen): the tuned winner on a GPU, the first candidate under the
    interpreter, cfg itself when pinned or when the class has no candidates. dims = (N, E, C, F).
    run must be repeatable (no accumulation into a buffer it does not zero itself)."""
    N, E, C, F = dims
    cls = shape_class(N, E)
    cands = candidates(kernel, cls, C, F)
    if pin_config._pinned is not None or not cands:
        return run(cfg)
    if device.type != "cuda":
        return run(with_tiles(cfg, kernel, cands[0]))
    tuner = TUNER if tuner is None else tuner
    key = (kernel, cls, str(dtype), C, F, E, torch.cuda.get_device_name(device))
    tiles = tuner.pick(key, cands, lambda t: run(with_tiles(cfg, kernel, t)))
    return run(with_tiles(cfg, kernel, tiles))
