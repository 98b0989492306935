"""The rules of the sm_90 compile tier, applied to a report of `python -m tools.sm90`.

Each rule returns a list of problems (empty = pass), one line each, naming the case and kernel:
  errors            a case raised (compile error, Triton's OutOfResources, a launcher check)
  over_shared       a variant needs more shared memory than an sm_90 block may have (227 KiB)
  hot_spills        a variant of the hot set (cases.HOT: decode, norms, MoE forward, log-prob
                    forward) spills at all; the hot set takes no exemptions
  unexempted_spills a spilling variant outside the hot set has no entry in exemptions.json, or
                    spills more than 1.25x the bytes its entry recorded (an entry's dtype "*"
                    matches any: moe_align's variants depend on the id count, not a float dtype)
  missing_kernels   a launched @triton.jit kernel of kernels/*.py compiled in no case
  missing_dtypes    a kernel lacks one of the dtypes the tier promises for it
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from tools.sm90.cases import ALL, HALF, HOT

EXEMPTIONS = Path(__file__).with_name("exemptions.json")
GROWTH = 1.25  # an exempted variant may spill up to this much more than recorded
KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _dt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def variants(report: dict):
    for case in report["cases"]:
        for v in case["variants"]:
            yield case, v


def is_hot(case: dict, variant: dict) -> bool:
    return case["dtype"] in {_dt(d) for d in HOT.get(variant["kernel"], ())}


def errors(report: dict) -> list[str]:
    return [f"{c['case']}: {c['error'].splitlines()[0]}" for c in report["cases"] if c["error"]]


def over_shared(report: dict) -> list[str]:
    limit = report["device_limits"]["max_shared_mem"]
    return [f"{c['case']}: {v['kernel']} needs {v['shared_bytes']} B of shared memory > {limit} B"
            for c, v in variants(report) if v["shared_bytes"] > limit]


def hot_spills(report: dict) -> list[str]:
    return [f"{c['case']}: {v['kernel']} spills {v['spill_bytes']} B/thread at {v['registers']} registers "
            f"(hot set: no spills allowed) {v['constants']}"
            for c, v in variants(report) if v["spill_bytes"] and is_hot(c, v)]


def _matches(entry: dict, case: dict, variant: dict) -> bool:
    return (entry["kernel"] == variant["kernel"] and entry["dtype"] in (case["dtype"], "*")
            and all(variant["constants"].get(k) == v for k, v in entry.get("match", {}).items()))


def unexempted_spills(report: dict, exemptions: list[dict] | None = None) -> list[str]:
    exemptions = load_exemptions() if exemptions is None else exemptions
    out = []
    for c, v in variants(report):
        if not v["spill_bytes"] or is_hot(c, v):
            continue
        entry = next((e for e in exemptions if _matches(e, c, v)), None)
        if entry is None:
            out.append(f"{c['case']}: {v['kernel']} spills {v['spill_bytes']} B/thread and has no exemption "
                       f"in {EXEMPTIONS.name} {v['constants']}")
        elif v["spill_bytes"] > GROWTH * entry["spill_bytes"]:
            out.append(f"{c['case']}: {v['kernel']} spills {v['spill_bytes']} B/thread, more than {GROWTH}x "
                       f"the {entry['spill_bytes']} B its exemption recorded")
    return out


def launched_kernels(kernel_dir: Path = KERNELS) -> set[str]:
    """@triton.jit functions that some launcher calls as NAME[grid](...)."""
    names = set()
    for path in sorted(kernel_dir.glob("*.py")):
        src = path.read_text()
        for name in re.findall(r"@triton\.jit[^\n]*\ndef (\w+)\(", src):
            if re.search(rf"\b{name}\[", src):
                names.add(name)
    return names


def missing_kernels(report: dict, kernel_dir: Path = KERNELS) -> list[str]:
    seen = {v["kernel"] for _, v in variants(report)}
    return [f"{name} never compiled: add its launches to tools/sm90/cases.py"
            for name in sorted(launched_kernels(kernel_dir) - seen)]


# dtypes each kernel must compile in; the rest get the two 16-bit types (moe_align takes int ids only)
_DTYPES = {"_split_kernel": ALL, "_merge_kernel": ALL, "_logprob_fwd_kernel": ALL, "_dlogits_kernel": ALL,
           "_moe_align_kernel": (), "_inv_logsumexp_kernel": (torch.float32,)}


def missing_dtypes(report: dict) -> list[str]:
    seen: dict[str, set[str]] = {}
    for c, v in variants(report):
        seen.setdefault(v["kernel"], set()).add(c["dtype"])
    out = []
    for kernel, got in sorted(seen.items()):
        want = {_dt(d) for d in _DTYPES.get(kernel, HALF)}
        if want - got:
            out.append(f"{kernel}: no variant in {', '.join(sorted(want - got))}")
    return out


def load_exemptions() -> list[dict]:
    entries = json.loads(EXEMPTIONS.read_text())["exemptions"]
    for e in entries:
        if not {"kernel", "dtype", "spill_bytes", "why"} <= e.keys():
            raise ValueError(f"{EXEMPTIONS.name}: an entry needs kernel, dtype, spill_bytes and why: {e}")
        if e["kernel"] in HOT and e["dtype"] in {_dt(d) for d in HOT[e["kernel"]]}:
            raise ValueError(f"{EXEMPTIONS.name}: {e['kernel']} in {e['dtype']} is in the hot set, "
                             "which takes no exemptions")
    return entries


RULES = {"errors": errors, "over_shared": over_shared, "hot_spills": hot_spills,
         "unexempted_spills": unexempted_spills, "missing_kernels": missing_kernels,
         "missing_dtypes": missing_dtypes}
