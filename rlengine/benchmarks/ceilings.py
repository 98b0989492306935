"""`rlengine bench ceilings`: measure copy bandwidth and matmul FLOP/s on this device."""

from __future__ import annotations

import argparse

import torch

from rlengine.analysis.ceilings import run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlengine bench ceilings", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="bench/results", help="directory for ceilings.json")
    p.add_argument("--reps", type=int, default=None)
    args = p.parse_args(argv)
    run(args.device, args.out, reps=args.reps)
    return 0
