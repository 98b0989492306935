"""PNG plots of the measurement outputs (matplotlib, Agg backend: no display needed).

`rlengine plot --kind KIND FILE.json [-o OUT.png]`, or the same arguments to tools/plots.py:
  python tools/plots.py decode bench/results/decode.json -o decode.png
      tokens/s and ms/step against B_act for rlengine and, where the rows carry them, transformers
      (hf_*, hf_static_*) and the roofline bound, one line per context
      (rows: b_act, tokens_per_s, ms_per_step[, hf_tokens_per_s, hf_ms_per_step, roofline_tokens_per_s, context])
  python tools/plots.py asymmetry bench/results/asymmetry.json -o asym.png
      responses and collection time normalised to the smallest batch, as grouped bars
      (rows: b, responses, t_gen[, t_train])
  python tools/plots.py ttt table1.json -o ttt.png
      normalised time-to-target against batch (rows: P, T_norm[, label])
  python tools/plots.py sweep bench/results/bench_packed_attention.json --x B --y loop_ms,padded_ms --group L,mode
      any sweep: one line per y column and per value of the group columns (log x when x spans > 8x)
  python tools/plots.py serve bench/results/serve.json -o serve.png
      TTFT / TPOT / ITL percentiles against request rate (rows: request_rate, *_ms percentiles)
Each input is a JSON object with a "rows" list (what rlengine/benchmarks/harness.py writes); a run's metrics.jsonl
is JSON Lines, which `rlengine plot RUN_DIR` draws (rlengine.plots.runs).
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


_DECODE_PROVIDERS = (("", "rlengine", "o-"), ("hf_", "transformers", "s--"),
                     ("hf_static_", "transformers static+compile", "^:"))


def plot_decode(data: dict, out: str | Path) -> Path:
    """Two panels against B_act (log2 x): tokens/s with the roofline bound, and ms per step; one line per
    provider present in the rows (rlengine, transformers hf_*, hf_static_*) and per context length."""
    rows = sorted(_rows(data, ("b_act", "tokens_per_s", "ms_per_step"), "decode"), key=lambda r: r["b_act"])
    contexts = sorted({r.get("context") for r in rows}, key=lambda c: (c is None, c))
    fig, (ax_q, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    for ctx in contexts:
        at = [r for r in rows if r.get("context") == ctx]
        tag = f", context {ctx}" if len(contexts) > 1 else ""
        for prefix, label, style in _DECODE_PROVIDERS:
            pts = [(r["b_act"], r[f"{prefix}tokens_per_s"], r[f"{prefix}ms_per_step"]) for r in at
                   if r.get(f"{prefix}tokens_per_s") is not None and r.get(f"{prefix}ms_per_step") is not None]
            if pts:
                b, q, t = zip(*pts)
                ax_q.plot(b, q, style, label=label + tag)
                ax_t.plot(b, t, style, label=label + tag)
        bound = [(r["b_act"], r["roofline_tokens_per_s"]) for r in at if r.get("roofline_tokens_per_s") is not None]
        if bound:
            ax_q.plot(*zip(*bound), "k--", lw=0.8, label="roofline bound (Eq. 5 of docs/METHOD.md)" + tag)
    ax_q.set(yscale="log", xlabel="B_act", ylabel="tokens/s", title="decode throughput")
    ax_t.set(xlabel="B_act", ylabel="ms / step", title="decode step latency")
    for ax in (ax_q, ax_t):
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
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


def plot_sweep(data: dict, out: str | Path, *, x: str, y: list[str], group: list[str] | None = None) -> Path:
    """One line per (y column, group value) against x; rows missing a y value are skipped for that line."""
    rows = _rows(data, (x,), "sweep")
    group = [g for g in (group or []) if g != x]
    lines: dict[tuple, list[tuple]] = {}
    for r in rows:
        key = tuple(r.get(g) for g in group)
        for col in y:
            if isinstance(r.get(col), (int, float)):
                lines.setdefault((col, key), []).append((r[x], r[col]))
    if not lines:
        raise ValueError(f"sweep: no numeric values for {y} in the rows")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (col, key), pts in lines.items():
        pts.sort()
        label = col + ("" if not group else " (" + ", ".join(f"{g}={v}" for g, v in zip(group, key)) + ")")
        ax.plot(*zip(*pts), "o-", label=label)
    xs = [r[x] for r in rows if isinstance(r[x], (int, float))]
    if xs and min(xs) > 0 and max(xs) / min(xs) > 8:
        ax.set_xscale("log", base=2)
    ax.set(xlabel=x, ylabel=", ".join(y), title=data.get("name", "sweep"))
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, out)


def plot_serving(data: dict, out: str | Path) -> Path:
    """Three panels against request rate: TTFT, TPOT and ITL (median and p99), vLLM's definitions."""
    rows = sorted(_rows(data, ("request_rate",), "serve"), key=lambda r: float(r["request_rate"]))
    rates = [float(r["request_rate"]) for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, metric in zip(axes, ("ttft", "tpot", "itl")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            vals = [r.get(f"{stat}_{metric}_ms") for r in rows]
            pts = [(a, v) for a, v in zip(rates, vals) if v is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=stat)
        ax.set(xlabel="request rate (req/s)", ylabel="ms", title=metric.upper())
        ax.legend()
        ax.grid(True, alpha=0.3)
    return _save(fig, out)


def read_rows_json(path: Path) -> dict:
    """The JSON object in `path`; ValueError naming the file when it is missing, not JSON, or JSON Lines
    (a run's metrics.jsonl, which `rlengine plot RUN_DIR` draws)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            raise ValueError(f"{path} holds one JSON object per line (JSON Lines, like a run's metrics.jsonl), "
                             "not one object with a 'rows' list; draw a run with `rlengine plot RUN_DIR`") from None
        raise ValueError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None


PLOTS = {"decode": plot_decode, "asymmetry": plot_asymmetry, "ttt": plot_time_to_target, "serve": plot_serving}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot rlengine measurement JSON to PNG.")
    parser.add_argument("kind", choices=sorted([*PLOTS, "sweep"]))
    parser.add_argument("input", type=Path, help="JSON with a 'rows' list")
    parser.add_argument("-o", "--out", type=Path, help="PNG path (default: input with .png)")
    parser.add_argument("--x", help="sweep: x column")
    parser.add_argument("--y", help="sweep: comma-separated y columns")
    parser.add_argument("--group", default="", help="sweep: comma-separated columns that tell lines apart")
    args = parser.parse_args(argv)
    try:
        data = read_rows_json(args.input)
    except ValueError as exc:
        parser.error(str(exc))
    out = args.out or args.input.with_suffix(".png")
    if args.kind == "sweep":
        if not args.x or not args.y:
            parser.error("sweep needs --x and --y")
        path = plot_sweep(data, out, x=args.x, y=args.y.split(","), group=[g for g in args.group.split(",") if g])
    else:
        path = PLOTS[args.kind](data, out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
