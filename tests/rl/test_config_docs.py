"""Every config field has one line of doc, and `rlengine config show` prints value, default and doc."""

import dataclasses

from rlengine.cli import main
from rlengine.rl.config import load_job_config
from rlengine.rl.config.docs import FIELD_DOCS
from rlengine.rl.config.sections import _SECTION_TYPES
from rlengine.rl.config.train_config import TrainConfig
from rlengine.rl.config.show import field_rows


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _SECTION_TYPES.items() for f in dataclasses.fields(cls)]


def test_every_field_of_every_section_has_a_doc():
    # the sections TrainConfig holds are exactly the ones listed for loading
    assert [f.name for f in dataclasses.fields(TrainConfig)] == list(_SECTION_TYPES)
    missing = [k for k in _all_keys() if k not in FIELD_DOCS]
    assert not missing, f"fields without a line in rlengine/rl/config/docs.py: {missing}"
    stale = sorted(set(FIELD_DOCS) - set(_all_keys()))
    assert not stale, f"docs for fields that do not exist: {stale}"
    for key, doc in FIELD_DOCS.items():
        assert doc.strip() and "\n" not in doc and len(doc) <= 140, key


def test_rows_carry_value_default_and_change_mark():
    cfg = load_job_config(None, ["--train.lr", "0.0042", "--gen.max_tokens", "13"])
    rows = {r.key: r for r in field_rows(cfg)}
    assert list(rows) == _all_keys()
    assert rows["train.lr"].value == 0.0042 and rows["train.lr"].default == 1e-3 and rows["train.lr"].changed
    assert rows["gen.max_tokens"].value == 13 and rows["gen.max_tokens"].changed
    # gen.b_gen = 0 stands for B_train: the value is what was written (0; the plan resolves it), the
    # default the declared 0, so it is not a change
    assert rows["gen.b_gen"].value == 0 and rows["gen.b_gen"].default == 0
    assert not rows["gen.b_gen"].changed and not rows["model.name"].changed
    assert rows["eval.sets"].default == {} and rows["train.betas"].default == (0.9, 0.99)


def test_config_show_prints_every_field(capsys):
    assert main(["config", "show", "--config", "grpo_long", "--train.lr", "0.0042"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[1] if line.startswith("*") else line.split()[0]: line
             for line in out.splitlines() if " = " in line and not line.startswith("(")}
    assert set(lines) == set(_all_keys())
    assert lines["train.lr"].startswith("* train.lr") and "0.0042" in lines["train.lr"]
    assert "(default 0.001)" in lines["train.lr"] and FIELD_DOCS["train.lr"] in lines["train.lr"]
    assert "'copy-digits'" in lines["task.name"] and "(default 'first-digit')" in lines["task.name"]
    assert "[model]" in out and "[run]" in out


def test_config_show_rejects_an_unknown_field(capsys):
    assert main(["config", "show", "--train.nope", "1"]) == 2
    assert "train.nope" in capsys.readouterr().err.strip().splitlines()[-1]
