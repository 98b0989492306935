"""The device clock: a run's T re-costed from its step trace with a device's step-cost table.

    clock = DeviceClock.load("docs/results/costs/tiny_float32_H200_modelled.json")
    records = clock.recost(records, read_trace(run_dir), run=str(run_dir))   # t_gen / t_train replaced
    clock.label          # "modelled H200 table docs/results/costs/..." : every table and figure names it
    clock.notes()        # steps outside the table's range, counted, with the range

T = N / q separates learning (N) from hardware (q). A run's trace (RUN_DIR/trace.jsonl, written by
rl/trainer/trace_file.py) holds every engine step as (kind, B_act, context) counts and the learner's
packed tokens per micro-batch pass and its optimizer steps. Re-costed on a table, one update takes

    t_gen   = sum over decode rows  steps x decode(B_act, mean context)  +  sum over prefill rows  steps x prefill(mean tokens)
    t_train = sum over fwd_bwd passes learner(tokens)  +  FORWARD_SHARE x sum over no-grad forwards learner(tokens)
              + optimizer steps x optimizer_s
    each    + host_update_s + responses x host_response_s   (the table's (gen, train) host terms)

What it assumes (docs/METHOD.md, "The device clock"): one process, so generation and training never
overlap and T is their sum; the engine's own host work (scheduling, sampling, output processing) is
inside the measured steps. What lies outside every step (the reward function, the collector's own
bookkeeping, building the TrainBatch, the learner's bookkeeping) is the table's host terms, per update
and per retained response (host_terms() measures them from a short run of the job on the table's own
device); a table without them counts that work 0 and notes() says so. A no-grad forward (the learner's
own old log-probs, a reference model's) costs FORWARD_SHARE of a forward + backward over the same tokens
(the usual 1 : 2 forward : backward). A PPO critic's passes are not in the trace.

Out of range: a step whose B_act, context or tokens lie outside the table is costed at the table's
nearest edge (clamped, never extrapolated) and counted; notes() reports the count and the ranges, and
`strict=True` refuses instead (ValueError naming the first such step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from rlengine.analysis.cost_table import CostTable

FORWARD_SHARE = 1.0 / 3.0


@dataclass(slots=True)
class _Outside:
    """Steps of one kind costed at the table's edge, and how far out they were."""

    steps: int = 0
    total: int = 0
    lo: tuple = ()         # smallest (B_act, context) or (tokens,) seen outside
    hi: tuple = ()         # largest


def measured_label(clock: str) -> str:
    """The clock name of a run timed by itself: "wall" or "cpu" (process CPU seconds)."""
    return {"cpu": "cpu (process CPU seconds)", "wall": "wall"}.get(clock, clock)


@dataclass(slots=True)
class DeviceClock:
    """Re-costs run traces with one CostTable; counts what falls outside it."""

    table: CostTable
    path: str                                      # the table's file, as the user named it
    strict: bool = False                           # refuse out-of-range steps instead of clamping
    outside: dict = field(default_factory=dict)    # kind -> _Outside
    mismatched: set = field(default_factory=set)   # (model, dtype) of runs the table was not made for
    runs: list = field(default_factory=list)       # per run: (name, its own T, clocked T, t_gen - step seconds;
    #                                                the last means something only for a wall-timed run)

    @staticmethod
    def load(path: str | Path, *, strict: bool = False) -> "DeviceClock":
        return DeviceClock(table=CostTable.load(path), path=str(path), strict=strict)

    @property
    def device(self) -> str:
        return str(self.table.provenance.get("device") or "unnamed device")

    @property
    def label(self) -> str:
        """"measured <device> table <file>" or "modelled <device> table <file>": what every figure says."""
        return f"{self.table.kind} {self.device} table {self.path}"

    # ---- one update ---------------------------------------------------------------------------
    def _cost(self, kind: str, key: tuple, value: tuple[float, bool], steps: int) -> float:
        seconds, out = value
        o = self.outside.setdefault(kind, _Outside())
        o.total += steps
        if out:
            if self.strict:
                raise ValueError(f"device clock: a {kind} step at {key} lies outside {self.label} "
                                 f"({self.range_text(kind)}); strict mode refuses to clamp it")
            o.steps += steps
            o.lo = min(o.lo, key) if o.lo else key
            o.hi = max(o.hi, key) if o.hi else key
        return seconds * steps

    def update_times(self, line: dict, responses: int = 0) -> tuple[float, float]:
        """(t_gen, t_train) of one trace.jsonl line on this clock; responses: retained in the update
        (what the table's per-response host terms are priced on)."""
        t = self.table
        t_gen = t.host_update_s[0] + responses * t.host_response_s[0]
        for b, steps, ctx_sum, _ in line.get("decode", ()):
            ctx = ctx_sum / steps
            t_gen += self._cost("decode", (b, round(ctx)), t.decode_s(b, ctx), steps)
        for _, steps, tok_sum, _ in line.get("prefill", ()):
            tokens = tok_sum / steps
            t_gen += self._cost("prefill", (round(tokens),), t.prefill_s(tokens), steps)
        lr = line.get("learner") or {}
        t_train = sum(self._cost("learner", (n,), t.learner_s(n), 1) for n in lr.get("fwd_bwd", ()))
        t_train += FORWARD_SHARE * sum(self._cost("learner", (n,), t.learner_s(n), 1) for n in lr.get("forward", ()))
        host_train = t.host_update_s[1] + responses * t.host_response_s[1]
        return t_gen, t_train + lr.get("optimizer_steps", 0) * t.optimizer_s + host_train

    # ---- one run --------------------------------------------------------------------------------
    def recost(self, records: Sequence[dict], trace: Sequence[dict], *, run: str = "run") -> list[dict]:
        """The run's metric records with t_gen / t_train (and q_gen, q) of every update replaced by this
        clock's; raises ValueError when an update has no trace line (a run from before the trace)."""
        by_update = {line["update"]: line for line in trace}
        out, measured, clocked, host, n_before = [], 0.0, 0.0, 0.0, 0
        for r in records:
            responses, n_before = r.get("N", n_before) - n_before, r.get("N", n_before)
            if r.get("update", 0) <= 0:
                out.append(r)
                continue
            line = by_update.get(r["update"])
            if line is None:
                raise ValueError(f"{run}: update {r['update']} has no line in trace.jsonl (the device clock needs "
                                 "the step trace every run writes since it was added; re-run, or use the run's own clock)")
            t_gen, t_train = self.update_times(line, responses)
            if not r.get("critic_only"):
                measured += r["t_gen"] + r["t_train"]
                clocked += t_gen + t_train
                host += max(0.0, line.get("t_gen", 0.0) - line.get("step_seconds", 0.0))
            b = r.get("q", 0) * (r["t_gen"] + r["t_train"])  # responses of the update
            out.append({**r, "t_gen": t_gen, "t_train": t_train, "q_gen": b / t_gen if t_gen > 0 else 0.0,
                        "q": b / (t_gen + t_train) if t_gen + t_train > 0 else 0.0,
                        "t_gen_measured": r["t_gen"], "t_train_measured": r["t_train"]})
        self.runs.append((run, measured, clocked, host))
        return out

    def check_model(self, model: str, dtype: str) -> None:
        """Note a run whose model or dtype is not the table's (re-costed all the same; notes() says so)."""
        if (model, dtype) != (self.table.model, self.table.dtype):
            self.mismatched.add((model, dtype))

    # ---- what it says -----------------------------------------------------------------------------
    def range_text(self, kind: str) -> str:
        t = self.table
        if kind == "decode":
            (b0, b1), (c0, c1) = t.decode_range()
            return f"B_act {b0}..{b1} x context {c0}..{c1}"
        points = t.prefill if kind == "prefill" else t.learner
        xs = sorted(p[0] for p in points)
        return f"tokens {xs[0]}..{xs[-1]}" if xs else "no points"

    def notes(self) -> list[str]:
        """One line per step kind with steps outside the table (clamped to its edge), and the clock used."""
        lines = []
        for kind, o in sorted(self.outside.items()):
            if o.steps:
                lines.append(f"clock: {o.steps} of {o.total} {kind} steps lie outside {self.label} "
                             f"({self.range_text(kind)}; seen {o.lo}..{o.hi}): costed at the table's edge, "
                             "not extrapolated")
        for model, dtype in sorted(self.mismatched):
            lines.append(f"clock: runs of {model} {dtype} re-costed on a table of {self.table.model} {self.table.dtype}")
        t = self.table
        if t.has_host_terms:
            (gu, tu), (gr, tr) = t.host_update_s, t.host_response_s
            lines.append(f"clock: host work outside the recorded steps from {self.label}: gen {gu:.4g} s per update "
                         f"+ {gr:.4g} s per response, train {tu:.4g} s + {tr:.4g} s")
        else:
            lines.append(f"clock: {self.label} has no host-work terms: the collector, rewards, batching and the "
                         "learner's bookkeeping outside the recorded steps count 0 s")
        if self.table.kind == "modelled":
            lines.append(f"clock: {self.label} is MODELLED (Eq. 5 plus a launch floor), not measured on the device")
        return lines

    def summary(self) -> dict:
        """The clock as the report's JSON holds it."""
        return {"label": self.label, "kind": self.table.kind, "device": self.device, "path": self.path,
                "host_update_s": list(self.table.host_update_s), "host_response_s": list(self.table.host_response_s),
                "outside": {k: dataclasses.asdict(v) for k, v in self.outside.items()},
                "runs": [{"run": n, "t_measured": m, "t_clock": c, "host_outside_steps": h} for n, m, c, h in self.runs]}


def host_terms(table: CostTable, runs: Sequence[tuple[Sequence[dict], Sequence[dict]]]) -> tuple[tuple, tuple]:
    """(host_update_s, host_response_s), each (gen, train): the host work outside the recorded steps of
    `runs` ((metric records, trace lines) of the job on the table's own device and clock), fitted per
    phase as measured - clocked on `table`'s steps alone = a + b x responses over every update by least
    squares. A negative a or b (noise) is set to 0 and the other refitted alone."""
    clock = DeviceClock(table=dataclasses.replace(table, host_update_s=(0.0, 0.0), host_response_s=(0.0, 0.0)),
                        path="host terms")
    xs, ys = [], []
    for records, trace in runs:
        for r in clock.recost(records, trace):
            if r.get("update", 0) > 0 and not r.get("critic_only"):
                xs.append(round(r["q"] * (r["t_gen"] + r["t_train"])))
                ys.append((r["t_gen_measured"] - r["t_gen"], r["t_train_measured"] - r["t_train"]))
    if not xs:
        raise ValueError("host_terms: the runs have no updates to measure host work on")
    fits = [_nonnegative_line(xs, [y[k] for y in ys]) for k in (0, 1)]
    return (fits[0][0], fits[1][0]), (fits[0][1], fits[1][1])


def _nonnegative_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(a, b) >= 0 of y = a + b x by least squares, a or b pinned to 0 where the free fit is negative."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    if sxx == 0 or b < 0:                     # one response count only, or a falling fit: per update alone
        return max(0.0, my), 0.0
    if a < 0:                                 # through the origin: per response alone
        return 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    return a, b
