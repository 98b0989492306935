"""PNG plots of the measurement outputs (matplotlib, Agg backend: no display needed).

  python tools/plots.py decode bench/results/decode.json -o decode.png
      tokens/s and ms/step against B_act, with the roofline bound when the rows carry it
      (rows: b_act, tokens_per_s, ms_per_step[, roofline_tokens_per_s])
  python tools/plots.py asymmetry bench/results/asymmetry.json -o asym.png
      responses and collection time normalised to the smallest batch, as grouped bars
      (rows: b, responses, t_gen[, t_train])
  python tools/plots.py ttt table1.json -o ttt.png
      normalised time-to-target against batch (rows: P, T_norm[, label])
Each input is a JSON object with a "rows" list (what bench/harness.py writes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _rows(data: dict, required: tuple[str, ...], what: str) -> list[dict]:
    rows = data.get("rows") if isinstance(data, dict) else None
    if not rows:
        raise ValueError(f"{what}: the JSON has no 'rows' list")
    missing = sorted({k for r in rows for k in required if k not in r})
    if missing:
        raise ValueError(f"{what}: rows lack field(s) {missing} (need {list(required)})")
    return rows


def _save(fig, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_decode(data: dict, out: str | Path) -> Path:
    """Two panels against B_act (log2 x): tokens/s with the roofline bound, and ms per step."""
    rows = sorted(_rows(data, ("b_act", "tokens_per_s", "ms_per_step"), "decode"), key=lambda r: r["b_act"])
    b = [r["b_act"] for r in rows]
    fig, (ax_q, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    ax_q.plot(b, [r["tokens_per_s"] for r in rows], "o-", label="measured")
    bound = [r.get("roofline_tokens_per_s") for r in rows]
    if any(v is not None for v in bound):
        pts = [(x, v) for x, v in zip(b, bound) if v is not None]
        ax_q.plot(*zip(*pts), "k--", label="roofline bound (Eq. 5)")
    ax_q.set(yscale="log", xlabel="B_act", ylabel="tokens/s", title="decode throughput")
    ax_q.set_xscale("log", base=2)
    ax_q.legend()
    ax_t.plot(b, [r["ms_per_step"] for r in rows], "o-")
    ax_t.set(xlabel="B_act", ylabel="ms / step", title="decode step latency")
    ax_t.set_xscale("log", base=2)
    for ax in (ax_q, ax_t):
        ax.grid(True, which="both", alpha=0.3)
    return _save(fig, out)


def plot_asymmetry(data: dict, out: str | Path) -> Path:
    """Grouped bars per batch: responses, t_gen (and t_train) normalised to the smallest batch."""
    rows = sorted(_rows(data, ("b", "responses", "t_gen"), "asymmetry"), key=lambda r: r["b"])
    ref = rows[0]
    series = [("responses", "responses"), ("t_gen", "collection time")]
    if all(r.get("t_train") for r in rows):
        series.append(("t_train", "training time"))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(rows)), 4))
    xs = range(len(rows))
    for j, (key, label) in enumerate(series):
        vals = [r[key] / ref[key] for r in rows]
        ax.bar([x + (j - (len(series) - 1) / 2) * width for x in xs], vals, width, label=label)
    for x, r in zip(xs, rows):
        q = (r["responses"] / r["t_gen"]) / (ref["responses"] / ref["t_gen"])
        top = max(r[k] / ref[k] for k, _ in series)
        ax.annotate(f"q_gen {q:.2f}x", (x, top), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"B={r['b']:g}" for r in rows])
    ax.set(ylabel=f"relative to B={ref['b']:g}", title="responses vs collection time")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, out)


def plot_time_to_target(data: dict, out: str | Path) -> Path:
    """Normalised time-to-target against batch (log2 x); labelled rows (controls) as separate points."""
    rows = _rows(data, ("P", "T_norm"), "time-to-target")
    main = sorted((r for r in rows if not r.get("label") or r["label"] == f"{r['P']:g}"), key=lambda r: r["P"])
    extra = [r for r in rows if r not in main]
    fig, ax = plt.subplots(figsize=(6, 4))
    if main:
        ax.plot([r["P"] for r in main], [r["T_norm"] for r in main], "o-", label="time to target")
        best = min(main, key=lambda r: r["T_norm"])
        ax.annotate(f"best {best['T_norm']:.2f}", (best["P"], best["T_norm"]), textcoords="offset points",
                    xytext=(0, -14), ha="center", fontsize=8)
    for r in extra:
        ax.plot(r["P"], r["T_norm"], "s", label=r["label"])
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.margins(y=0.15)  # room for the "best" label under the minimum
    ax.set_xscale("log", base=2)
    ax.set(xlabel="P (prompts per update)", ylabel="T / T_ref", title="time to target")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, out)


PLOTS = {"decode": plot_decode, "asymmetry": plot_asymmetry, "ttt": plot_time_to_target}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot rlengine measurement JSON to PNG.")
    parser.add_argument("kind", choices=sorted(PLOTS))
    parser.add_argument("input", type=Path, help="JSON with a 'rows' list")
    parser.add_argument("-o", "--out", type=Path, help="PNG path (default: input with .png)")
    args = parser.parse_args(argv)
    data = json.loads(args.input.read_text())
    path = PLOTS[args.kind](data, args.out or args.input.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
