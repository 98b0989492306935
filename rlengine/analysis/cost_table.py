"""A device's step costs for one model shape and dtype: what `rlengine bench costs` writes and the
device clock (re-costing a run's step trace on another device) reads.

A table holds four measured (or modelled) cost curves, each a grid of points in seconds:
    decode     (B_act, context) -> one decode step  (context: mean tokens attended per sequence)
    prefill    tokens -> one prefill step
    learner    tokens -> one learner forward + backward (log-probs, entropy) over that many packed tokens
    optimizer  one optimizer step over the model's parameters
and the job's host work outside every recorded step (the collector, rewards, building the batch, the
learner's bookkeeping), per update and per retained response, for the generation and training phases:
    host_update_s, host_response_s   (gen seconds, train seconds)
A table without them (older files, modelled tables, `rlengine bench costs`) loads with 0: that work is
then left out of a clocked T, and the clock's notes say so.
with its provenance (device, clocks, commit, versions, how it was made). A modelled table (Eq. 5
plus a launch floor, made before any run on that device) says so in `kind`, and every figure made
from it must say so too. JSON on disk (never pickle): CostTable.save / CostTable.load, which checks
the layout and names the field that is wrong.

Reading a cost (decode_s, prefill_s, learner_s): linear interpolation between points (bilinear on the
decode grid in B_act and context). A query outside the table's range is clamped to the nearest edge and
flagged, never extrapolated; the device clock (rlengine/tune/clock.py) counts and reports every such step.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "rlengine.cost_table/1"
KINDS = ("measured", "modelled")


@dataclass(frozen=True, slots=True, kw_only=True)
class CostTable:
    """Step costs of one model shape and dtype on one device."""

    model: str                                   # preset name or checkpoint, as the user named it
    dtype: str                                   # float32 | bfloat16 | float16
    kind: str                                    # measured | modelled
    decode: tuple[tuple[int, int, float], ...]   # (B_act, context tokens, seconds per decode step)
    prefill: tuple[tuple[int, float], ...]       # (prompt tokens in the step, seconds)
    learner: tuple[tuple[int, float], ...]       # (packed tokens, seconds of forward + backward)
    optimizer_s: float                           # seconds of one optimizer step
    host_update_s: tuple[float, float] = (0.0, 0.0)    # (gen, train) seconds per update outside every step
    host_response_s: tuple[float, float] = (0.0, 0.0)  # (gen, train) seconds per retained response, likewise
    provenance: dict = field(default_factory=dict)  # device, clocks, commit, versions, threads, method

    def __post_init__(self):
        def bad(what: str) -> ValueError:
            return ValueError(f"cost table ({self.model}, {self.dtype}): {what}")

        if self.kind not in KINDS:
            raise bad(f"kind must be {'|'.join(KINDS)}, got {self.kind!r}")
        if not self.decode or any(len(p) != 3 or p[0] < 1 or p[1] < 1 or not p[2] > 0 for p in self.decode):
            raise bad("decode needs (B_act >= 1, context >= 1, seconds > 0) points")
        for name in ("prefill", "learner"):
            points = getattr(self, name)
            if any(len(p) != 2 or p[0] < 1 or not p[1] > 0 for p in points):
                raise bad(f"{name} needs (tokens >= 1, seconds > 0) points")
        if not self.optimizer_s >= 0:
            raise bad(f"optimizer_s must be >= 0, got {self.optimizer_s}")
        for name in ("host_update_s", "host_response_s"):
            pair = getattr(self, name)
            if len(pair) != 2 or not all(x >= 0 for x in pair):
                raise bad(f"{name} must be (gen seconds >= 0, train seconds >= 0), got {pair}")

    @property
    def has_host_terms(self) -> bool:
        """Whether the table prices the host work outside the recorded steps (else it counts 0)."""
        return any(self.host_update_s) or any(self.host_response_s)

    def to_dict(self) -> dict:
        """The JSON layout; the host terms only when the table has them (without, the file is the older layout)."""
        host = ({"host_update_s": list(self.host_update_s), "host_response_s": list(self.host_response_s)}
                if self.has_host_terms else {})
        return {"format": FORMAT, "model": self.model, "dtype": self.dtype, "kind": self.kind,
                "decode": [list(p) for p in self.decode], "prefill": [list(p) for p in self.prefill],
                "learner": [list(p) for p in self.learner], "optimizer_s": self.optimizer_s, **host,
                "provenance": self.provenance}

    @staticmethod
    def from_dict(d: dict) -> "CostTable":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a cost table: format must be {FORMAT!r}, got "
                             f"{d.get('format') if isinstance(d, dict) else type(d).__name__!r}")
        try:
            return CostTable(model=str(d["model"]), dtype=str(d["dtype"]), kind=str(d["kind"]),
                             decode=tuple((int(b), int(c), float(s)) for b, c, s in d["decode"]),
                             prefill=tuple((int(t), float(s)) for t, s in d["prefill"]),
                             learner=tuple((int(t), float(s)) for t, s in d["learner"]),
                             optimizer_s=float(d["optimizer_s"]),
                             host_update_s=_pair(d.get("host_update_s")),
                             host_response_s=_pair(d.get("host_response_s")),
                             provenance=dict(d.get("provenance") or {}))
        except KeyError as exc:
            raise ValueError(f"cost table: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if str(exc).startswith("cost table"):
                raise
            raise ValueError(f"cost table: a point is not (numbers ...): {exc}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @staticmethod
    def load(path: str | Path) -> "CostTable":
        path = Path(path)
        try:
            return CostTable.from_dict(json.loads(path.read_text()))
        except OSError as exc:
            raise ValueError(f"cost table {path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"cost table {path}: not JSON ({exc})") from None

    # ---- reading a cost off the table (the device clock) ----------------------------------------
    def decode_s(self, b_act: float, context: float) -> tuple[float, bool]:
        """(seconds of one decode step, outside) by bilinear interpolation on the (B_act, context) grid.

        The decode points must form a full grid (every B_act at every context). A point outside the
        grid is clamped to its edge, never extrapolated: outside is then True and the caller reports it.
        """
        bs, cs, s = self._decode_grid()
        (i, u, out_b), (j, v, out_c) = _locate(bs, b_act), _locate(cs, context)
        i2, j2 = min(i + 1, len(bs) - 1), min(j + 1, len(cs) - 1)
        top = s[i][j] * (1 - v) + s[i][j2] * v
        bottom = s[i2][j] * (1 - v) + s[i2][j2] * v
        return top * (1 - u) + bottom * u, out_b or out_c

    def prefill_s(self, tokens: float) -> tuple[float, bool]:
        """(seconds of one prefill step of `tokens`, outside): linear between points, clamped at the ends."""
        return _linear(self.prefill, tokens, "prefill", self)

    def learner_s(self, tokens: float) -> tuple[float, bool]:
        """(seconds of one learner forward + backward over `tokens` packed tokens, outside), as prefill_s."""
        return _linear(self.learner, tokens, "learner", self)

    def decode_range(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((B_act min, max), (context min, max)) of the decode grid."""
        bs, cs, _ = self._decode_grid()
        return (bs[0], bs[-1]), (cs[0], cs[-1])

    def _decode_grid(self) -> tuple[list[int], list[int], list[list[float]]]:
        grid = _grid(self.decode)
        if isinstance(grid, str):
            raise ValueError(f"cost table ({self.model}, {self.dtype}): {grid}")
        return grid


def _pair(value) -> tuple[float, float]:
    """A (gen, train) host term as stored; a table written before the host terms has none: (0, 0)."""
    if value is None:
        return (0.0, 0.0)
    gen, train = value
    return (float(gen), float(train))


@functools.lru_cache(maxsize=16)
def _grid(decode: tuple) -> tuple | str:
    """(B_act values, contexts, seconds [B][context]) of decode points, or what keeps them from a grid."""
    bs, cs = sorted({p[0] for p in decode}), sorted({p[1] for p in decode})
    at = {(b, c): s for b, c, s in decode}
    missing = [(b, c) for b in bs for c in cs if (b, c) not in at]
    if missing:
        return f"decode points must form a grid (every B_act at every context); missing (B_act, context) {missing[:4]}"
    return bs, cs, [[at[b, c] for c in cs] for b in bs]


def _locate(grid: list[int], x: float) -> tuple[int, float, bool]:
    """(index i, weight u of grid[i + 1], outside) for x on a sorted grid, clamped to its ends."""
    if x <= grid[0] or len(grid) == 1:
        return 0, 0.0, x < grid[0] or (len(grid) == 1 and x > grid[0])
    if x >= grid[-1]:
        return len(grid) - 1, 0.0, x > grid[-1]
    i = max(k for k in range(len(grid) - 1) if grid[k] <= x)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i]), False


def _linear(points, x: float, name: str, table: CostTable) -> tuple[float, bool]:
    if not points:
        raise ValueError(f"cost table ({table.model}, {table.dtype}) has no {name} points to cost a {name} step with")
    pts = sorted(points)
    xs = [p[0] for p in pts]
    i, u, outside = _locate(xs, x)
    j = min(i + 1, len(pts) - 1)
    return pts[i][1] * (1 - u) + pts[j][1] * u, outside
