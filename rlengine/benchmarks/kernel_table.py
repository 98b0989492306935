"""`rlengine info --kernels MODEL`: the CPU kernel choices for a model's decode shapes, with their timings.

Decides (model/ops.decide_for_model) every projection and LM-head shape class of the model
for B_act 1-8, 16, 32, 64 on random weights, and the prefill attention (model/attention.decide_prefill)
for 1 and 4 prompts of 64, 512 and 2048 tokens, through the setting the user would run with (cache by
default: a table already on disk is shown, not re-timed), and prints one line per class: the choice,
each candidate's median ms and the chosen one's ratio to torch's. --save writes the table, which
`cpu_kernels=PATH` / `--gen.cpu_kernels PATH` then pins.
"""

from __future__ import annotations

import torch

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64]
PREFILL_LENGTHS, PREFILL_BATCHES = [64, 512, 2048], [1, 4]  # the prefill attention classes decided


def format_table(table: dict) -> list[str]:
    names = ("torch", "skinny", "upcast", "blocked", "padded")
    lines = [f"  {'shape class':40s} {'choice':7s} " + " ".join(f"{n + ' ms':>10s}" for n in names)
             + f" {'vs torch':>9s} source"]
    for key, d in sorted(table.items()):
        ms = d.get("ms") or {}
        cells = " ".join(f"{ms[n]:10.3f}" if n in ms else f"{'-':>10s}" for n in names)
        ratio = f"{ms[d['impl']] / ms['torch']:9.2f}" if ms.get("torch") and d["impl"] in ms else f"{'-':>9s}"
        lines.append(f"  {key:40s} {d['impl']:7s} {cells} {ratio} {d.get('source', '')}")
    return lines


def kernels_info(model: str, dtype: str, setting: str = "cache", save: str | None = None) -> int:
    from rlengine.model.config import preset
    from rlengine.model import ops
    from rlengine.model.kernel_choice import configure_from_setting, machine_key
    from rlengine.model.attention import decide_prefill
    from rlengine.model.ops import decide_for_model

    cfg = preset(model)
    configure_from_setting(ops.KERNELS, setting)
    decide_for_model(cfg, getattr(torch, dtype), ROWS)
    lengths = [S for S in PREFILL_LENGTHS if S <= cfg.max_position_embeddings]
    decide_prefill(cfg, getattr(torch, dtype), lengths, PREFILL_BATCHES)
    table = ops.KERNELS.to_dict()
    m = machine_key()
    print(f"CPU kernel choices for {model} ({dtype}) on {m['cpu']} (flags {m['flags_sha1']}), torch {m['torch']}, "
          f"{m['threads']} threads; mode {ops.KERNELS.mode}"
          + (f", cache {ops.KERNELS.cache_path()}" if ops.KERNELS.cache_dir else ""))
    print("\n".join(format_table(table)))
    if save:
        print(f"saved: {ops.KERNELS.save(save)} (pin it with --gen.cpu_kernels {save})")
    return 0
