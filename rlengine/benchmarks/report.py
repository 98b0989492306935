"""Tables and result files of the installed benchmarks (harness.py re-uses the table).

format_table prints rows as an aligned plain-text table; write_result writes {out}/{name}.json
with the rows, any extra fields and the provenance (telemetry/provenance.py) under
"conditions", and says where it went. free_name picks a result name that leaves earlier
result files alone unless the user named the file.
"""

from __future__ import annotations

from pathlib import Path

from rlengine.telemetry.provenance import write_json


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Aligned plain-text table of dict rows (floats shown with 4 significant digits, None as '-')."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))  # noqa: E731
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def write_result(out: str | Path, name: str, rows: list[dict], *, conditions: dict | None = None, device=None,
                 llm=None, **extra) -> Path:
    """{out}/{name}.json = {"name", "rows", **extra, "conditions": provenance + conditions}."""
    payload = {"name": name, "rows": rows, **extra, "conditions": conditions or {}}
    path = write_json(Path(out) / f"{name}.json", payload, device=device, llm=llm)
    print(f"wrote {path}")
    return path


def free_name(out: str | Path, name: str | None, default: str, suffixes: tuple[str, ...] = (".json",)) -> str:
    """The result name to write under `out`: `name` when the user gave one (an existing file of that
    name is replaced, and the caller says so), else `default`, or default-2, default-3, ... when
    {out}/{default}{suffix} exists for any suffix, so an earlier default-named result is never overwritten."""
    if name is not None:
        return name
    taken = lambda n: any((Path(out) / f"{n}{s}").exists() for s in suffixes)  # noqa: E731
    candidate, i = default, 1
    while taken(candidate):
        i += 1
        candidate = f"{default}-{i}"
    return candidate
