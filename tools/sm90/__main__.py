"""python -m tools.sm90 [--out report.json] [--models a,b] [--only SUBSTR]: the sm_90 compile tier.

Compiles every case of cases.py through the stand-in driver and writes one JSON report: the triton
version, then per case its error (or null) and per compiled variant its registers, spills, shared
memory and MMA kind. Exit status 0 even when cases fail: test_sm90_compile judges the report
(compile errors, the shared-memory limit, spills against exemptions.json). Run it from the
repository root with TRITON_INTERPRET unset; Triton's cache (TRITON_CACHE_DIR) makes reruns fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.sm90", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sm90_report.json", help="report path (default: %(default)s)")
    parser.add_argument("--models", default=None, help="comma-separated presets (default: all three)")
    parser.add_argument("--only", default=None, help="run only cases whose name contains this")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # must be unset before triton.jit decorates the kernels

    import torch
    import triton

    from tools.sm90.cases import MODELS, cases
    from tools.sm90.standin import SM90, fake_cuda, sm90_standin

    models = tuple(args.models.split(",")) if args.models else MODELS
    results, t0 = [], time.perf_counter()
    with sm90_standin() as driver:
        for case in cases(models):
            if args.only and args.only not in case.name:
                continue
            driver.case, start, error = case.name, len(driver.variants), None
            t = time.perf_counter()
            try:
                with fake_cuda():
                    case.run()
            except Exception as exc:  # noqa: BLE001 - every failure is reported, the rest still compile
                error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
            variants = [dataclasses.asdict(v) for v in driver.variants[start:]]
            results.append({"case": case.name, "dtype": str(case.dtype).removeprefix("torch."), "error": error,
                            "seconds": round(time.perf_counter() - t, 2), "variants": variants})
            status = "FAIL" if error else f"{len(variants):2d} new"
            print(f"{case.name:48s} {status}  {time.perf_counter() - t:5.1f} s", flush=True)
    report = {"triton": triton.__version__, "torch": torch.__version__, "target": "cuda sm_90",
              "device_limits": SM90, "seconds": round(time.perf_counter() - t0, 1), "cases": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    n_var = sum(len(r["variants"]) for r in results)
    n_err = sum(r["error"] is not None for r in results)
    print(f"{len(results)} cases, {n_var} variants, {n_err} failed, {report['seconds']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
