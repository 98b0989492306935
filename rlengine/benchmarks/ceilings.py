"""`rlengine bench ceilings`: measure copy bandwidth and matmul FLOP/s on this device.

The measurement is rlengine.analysis.ceilings; this front adds the provenance (commit, dirty
flag, device, versions) that every benchmark JSON records.
"""

from __future__ import annotations

import argparse
import json

import torch

from rlengine.analysis.ceilings import run
from rlengine.benchmarks.args import check_args
from rlengine.telemetry.provenance import write_json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlengine bench ceilings", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="bench/results", help="directory for ceilings.json")
    p.add_argument("--reps", type=int, default=None)
    args = p.parse_args(argv)
    check_args(args, positive=("reps",))
    path = run(args.device, args.out, reps=args.reps)
    write_json(path, json.loads(path.read_text()), device=args.device)
    return 0
