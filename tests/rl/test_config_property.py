"""Property tests of the two parsers of user input: config overrides / tables and JSONL rows.

Random `--section.key value` overrides (real keys with random values, junk keys), random config
tables (what a TOML file or a run's config.json gives) and random JSONL lines either parse into
values of the declared field types (int fields hold ints and never bools, float fields floats,
tuple fields tuples of the declared element types, ...) or raise the project's own ConfigError
(DatasetError is one): never a TypeError, KeyError or any other exception.
"""

import dataclasses
import json
import math
import tempfile
import types
import typing
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlengine.model.config import ConfigError
from rlengine.rl.config import TrainConfig, load_job_config, split_overrides
from rlengine.rl.config.sections import _SECTION_TYPES
from rlengine.rl.data.tasks import DatasetError, Problem, gsm8k_row, read_jsonl

SETTINGS = settings(deadline=None, max_examples=150, database=None, suppress_health_check=[HealthCheck.too_slow])
FIELDS = {section: typing.get_type_hints(cls) for section, cls in _SECTION_TYPES.items()}
REAL_KEYS = [f"{s}.{k}" for s, hints in FIELDS.items() for k in hints]


def has_type(value, tp) -> bool:
    """isinstance against an annotation, strictly: bool is not an int, an int is not a float."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(has_type(value, a) for a in args)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(has_type(v, args[0]) for v in value)
        return len(value) == len(args) and all(has_type(v, a) for v, a in zip(value, args))
    if origin is list:
        return isinstance(value, list) and all(has_type(v, args[0]) for v in value) if args else isinstance(value, list)
    if origin is dict:
        kt, vt = args or (object, object)
        return isinstance(value, dict) and all(has_type(k, kt) and has_type(v, vt) for k, v in value.items())
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, float) and math.isfinite(value)
    if tp in (bool, str, dict, list, tuple, type(None)):
        return isinstance(value, tp)
    raise AssertionError(f"no rule for the annotation {tp!r}: add one here and in rl/config/values.py typed")


def assert_typed(cfg: TrainConfig) -> None:
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        for name, tp in FIELDS[section.name].items():
            value = getattr(obj, name)
            assert has_type(value, tp), f"{section.name}.{name} = {value!r} is not {tp}"


# ---- override strings --------------------------------------------------------------------------
toml_literals = st.one_of(
    st.integers(-10**6, 10**6).map(str), st.integers().map(str), st.floats(allow_nan=True).map(repr),
    st.sampled_from(["true", "false", "inf", "-inf", "nan", "1e400", "0x1f", "1_000", "[]", "[0.9, 0.99]",
                     "[1, 2]", "[0.9]", "[true, false]", "['a', 1]", "{a = 1}", '{a = "x.jsonl"}',
                     "1979-05-27", "12:30:00",
                     '"quoted"', "'single'", '""', "1.5", "-0", "1\nw = 2", "[1,\n2]", "=", "--x",
                     "1" + "0" * 400, "-" + "9" * 400]),
)
values = st.one_of(toml_literals, st.text(max_size=12))
keys = st.one_of(st.sampled_from(REAL_KEYS), st.text(max_size=10),
                 st.builds(lambda s, k: f"{s}.{k}", st.sampled_from(list(FIELDS) + ["nope", ""]), st.text(max_size=6)))


@st.composite
def override_lists(draw) -> list[str]:
    args = []
    for _ in range(draw(st.integers(0, 4))):
        key, value = draw(keys), draw(values)
        form = draw(st.sampled_from(["pair", "equals", "bare", "no-dashes"]))
        args += {"pair": [f"--{key}", value], "equals": [f"--{key}={value}"], "bare": [f"--{key}"],
                 "no-dashes": [key, value]}[form]
    return args


@SETTINGS
@given(override_lists())
def test_random_overrides_parse_to_declared_types_or_raise_config_error(args):
    try:
        cfg = load_job_config(None, args)
    except ConfigError:
        return
    assert_typed(cfg)


@SETTINGS
@given(override_lists())
def test_split_overrides_gives_dotted_keys_or_config_error(args):
    try:
        pairs = split_overrides(args)
    except ConfigError:
        return
    for key, value in pairs:
        assert isinstance(key, str) and "." in key and isinstance(value, str)


@SETTINGS
@given(st.sampled_from(REAL_KEYS), toml_literals)
def test_every_real_field_with_a_random_literal(key, value):
    """One real field at a time, so a value that parses is checked against that field's type."""
    try:
        cfg = load_job_config(None, [f"--{key}", value])
    except ConfigError:
        return
    assert_typed(cfg)


# ---- config tables (a TOML file's or a saved config.json's contents) ------------------------------
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                         max_size=3), max_leaves=6)


@st.composite
def config_tables(draw) -> dict:
    table = {}
    for _ in range(draw(st.integers(0, 4))):
        section = draw(st.sampled_from(list(FIELDS) + ["nope"]))
        if draw(st.integers(0, 9)) == 0:
            table[section] = draw(json_values)           # a section that is not a table
            continue
        sec = table.setdefault(section, {}) if isinstance(table.get(section, {}), dict) else {}
        for _ in range(draw(st.integers(0, 3))):
            name = draw(st.sampled_from(list(FIELDS.get(section, {})) or ["x"]) | st.text(max_size=5))
            sec[name] = draw(json_values)
    return table


@SETTINGS
@given(config_tables())
def test_random_tables_parse_to_declared_types_or_raise_config_error(table):
    for build in (lambda: TrainConfig.from_dict(table), lambda: load_job_config(None, [], base=table)):
        try:
            cfg = build()
        except ConfigError:
            continue
        assert_typed(cfg)


# ---- JSONL rows ------------------------------------------------------------------------------------
rows = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(max_size=10), "answer": st.text(max_size=5)}),
    st.fixed_dictionaries({"prompt": json_values, "answer": json_values}),
    st.dictionaries(st.sampled_from(["prompt", "answer", "extra"]) | st.text(max_size=4), json_values, max_size=3),
    json_values,
)
lines = st.one_of(
    rows.map(lambda r: json.dumps(r, ensure_ascii=False)), rows.map(json.dumps),
    st.text(max_size=20),
    st.sampled_from(["", "   ", "{", "NaN", '{"prompt": "a", "answer": "b"', '{"prompt": "a" "answer": "b"}']),
)


@SETTINGS
@given(st.lists(lines, max_size=6))
def test_random_jsonl_lines_parse_to_string_problems_or_raise_dataset_error(file_lines):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        path.write_text("\n".join(file_lines), encoding="utf-8", errors="surrogatepass")
        try:
            problems = read_jsonl(path)
        except DatasetError as exc:
            assert "data.jsonl" in str(exc)
            return
    assert problems
    for p in problems:
        assert isinstance(p, Problem) and isinstance(p.prompt, str) and p.prompt.strip()
        assert isinstance(p.answer, str) and p.source.startswith(str(path))


@SETTINGS
@given(st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=10).filter(str.strip),
                              "answer": st.text(max_size=5).filter(lambda a: gsm8k_row({"answer": a})["answer"] == a)}))
def test_a_valid_row_round_trips(row):
    """A well-formed row, written as JSON (raw Unicode, including line separators), reads back unchanged
    (answers holding a GSM8K "#### N" final line are mapped to N: tests/rl/test_gsm8k_example_job.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        path.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8", errors="surrogatepass")
        [problem] = read_jsonl(path)
    assert (problem.prompt, problem.answer) == (row["prompt"], row["answer"])
