"""Typed config values: how a TOML / JSON / command-line value becomes its field's declared type.

sections.py's dataclasses declare their fields' types; from_dict runs every value through `typed`
before the section's __post_init__ checks ranges, and load_job_config parses override text with
`parse_value`. The rules: a bool is not an int, an int is accepted for a float (finite only), a
list becomes a tuple for tuple fields, a field declared str keeps its text as typed
(--run.out_dir 2024 is "2024"), and any other mismatch is a ConfigError naming `section.field`
and the expected type.
"""

from __future__ import annotations

import math
import tomllib
import types
import typing

from rlengine.model.config import ConfigError


def parse_value(text: str, declared=None):
    """A command-line override value: TOML scalar syntax, bare words as strings. For a field
    declared `str` the text itself, unless it is a quoted TOML string (so --run.out_dir 2024 is "2024")."""
    try:
        parsed = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    if list(parsed) != ["v"]:  # "1\nw = 2": more than one value, so not a TOML scalar
        return text
    value = parsed["v"]
    return text if declared is str and not isinstance(value, str) else value


def describe(tp) -> str:
    """How an error message names the declared type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list (each {describe(args[0])})"
        return f"a list of {len(args)} values ({', '.join(describe(a) for a in args)})"
    if origin is list:
        return f"a list (each {describe(args[0])})" if args else "a list"
    if origin is dict:
        return f"a table (each value {describe(args[1])})" if args else "a table"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a table",
            type(None): "absent"}.get(tp, getattr(tp, "__name__", str(tp)))


def typed(where: str, value, tp):
    """`value` (from TOML, JSON or an override) as the declared type `tp` of field `where`: an int is
    accepted for a float; bools are not ints; lists become tuples. ConfigError naming the field otherwise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ConfigError(f"{where} must be {describe(tp)}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        for member in args:
            try:
                return typed(where, value, member)
            except ConfigError:
                pass
        raise bad
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise bad
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise bad
            return tuple(typed(f"{where}[{i}]", v, t) for i, (v, t) in enumerate(zip(value, args)))
        items = [typed(f"{where}[{i}]", v, args[0]) if args else v for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        kt, vt = args or (typing.Any, typing.Any)
        return {typed(f"{where} key", k, kt): typed(f"{where}.{k}", v, vt) for k, v in value.items()}
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= 1e308
        if not ok or not math.isfinite(value):  # the bound: float(10**400) would overflow
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp in (bool, str, dict, type(None)):
        if not isinstance(value, tp):
            raise bad
        return value
    return value  # a type this parser has no rule for: the section's __post_init__ checks it
