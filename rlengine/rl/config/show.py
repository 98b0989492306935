"""`rlengine config show`: every field of a job's config with its value, its default and one line of doc.

The value is the loaded config's (file plus overrides, as written: gen.b_gen = 0 stays 0, the B_train it
stands for is resolved by the plan stage); the default is the dataclass field's as declared. Rows marked
`*` differ from what the same field is in a config with no file and no overrides. Docs come from docs.py; a field without one is a bug that the tests catch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlengine.rl.config.docs import FIELD_DOCS
from rlengine.rl.config.sections import _SECTION_TYPES
from rlengine.rl.config.train_config import TrainConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class FieldRow:
    """One config field as `config show` prints it."""

    key: str        # "section.field"
    value: object   # the loaded config's value
    default: object  # the dataclass default
    doc: str        # one line from FIELD_DOCS
    changed: bool   # differs from a config built from nothing (TrainConfig())


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def field_rows(cfg: TrainConfig) -> list[FieldRow]:
    """Every field of every section of `cfg`, in declaration order."""
    rows, baseline = [], TrainConfig()
    for section, cls in _SECTION_TYPES.items():
        values, base = getattr(cfg, section), getattr(baseline, section)
        for f in dataclasses.fields(cls):
            key, value = f"{section}.{f.name}", getattr(values, f.name)
            rows.append(FieldRow(key=key, value=value, default=_default(f), doc=FIELD_DOCS.get(key, "(undocumented)"),
                                 changed=value != getattr(base, f.name)))
    return rows


def _text(value: object) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def format_rows(rows: list[FieldRow]) -> list[str]:
    """Aligned lines, one [section] header per section: `* key = value  (default d)  doc`."""
    width_key = max(len(r.key) for r in rows)
    width_value = min(24, max(len(_text(r.value)) for r in rows))
    width_default = min(32, max(len(f"(default {_text(r.default)})") for r in rows))
    lines, section = [], None
    for r in rows:
        if r.key.split(".")[0] != section:
            section = r.key.split(".")[0]
            lines.append(f"[{section}]")
        mark = "*" if r.changed else " "
        default = f"(default {_text(r.default)})"
        lines.append(f"{mark} {r.key:<{width_key}} = {_text(r.value):<{width_value}}  {default:<{width_default}}  {r.doc}")
    return lines
