"""A tour of bad inputs to train, tune, report, generate, bench and the Python API: each ends in one
clear line (exit 2 on the command line, a typed error in the API) and touches nothing it must not.

Every command-line case runs in process through rlengine.cli.main and must be refused while the
command checks its input: the heavy entry points are stand-ins that fail the case if reached. Run
directories here are fabricated (a config.json and a checkpoint's state.json are all the checks
read), and a snapshot of the temporary directory taken before each case must be unchanged after
it, but for the run directory the case names (which a preflight may create empty). A read-only
filesystem is injected at the file layer (tests run as root, where chmod stops no write).
"""

import errno
import io
import json
import os
from pathlib import Path

import pytest

from rlengine.cli import main
from rlengine.rl.config import TrainConfig

JSONL = ["--task.name", "jsonl", "--task.reward", "exact", "--task.path"]


def _run_dir(path: Path, update: int | None = 160, metrics_through: int = 0) -> str:
    """A run directory as a resume's checks see it: config.json, metrics, and (update) a checkpoint's state."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TrainConfig().to_dict()))
    (path / "metrics.jsonl").write_text("".join(json.dumps({"update": u}) + "\n" for u in range(metrics_through + 1)))
    if update is not None:
        ckpt = path / "checkpoints" / f"update-{update:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps({"update": update, "N": 128 * update}))
        (path / "checkpoints" / "latest").write_text(ckpt.name)
    return str(path)


def _files(tmp: Path) -> dict[str, str]:
    (tmp / "a_file").write_text("not a directory\n")
    (tmp / "a_dir").mkdir()
    (tmp / "table.toml").write_text("train = 5\n")
    (tmp / "empty.jsonl").write_text("\n")
    truncated = _run_dir(tmp / "truncated_state")
    (Path(truncated) / "checkpoints" / "update-000160" / "state.json").write_text('{"update": 16')
    dangling = _run_dir(tmp / "dangling")
    (Path(dangling) / "checkpoints" / "latest").write_text("update-000999")
    return {"file": str(tmp / "a_file"), "dir": str(tmp / "a_dir"), "table_toml": str(tmp / "table.toml"),
            "empty_jsonl": str(tmp / "empty.jsonl"), "run": _run_dir(tmp / "run"), "other": _run_dir(tmp / "other"),
            "truncated_state": truncated, "dangling": dangling, "missing": str(tmp / "missing"),
            "ro": str(tmp / "ro"), "out": str(tmp / "out")}


# (id, argv, text the last stderr line must contain, text it must not contain)
CASES = [
    # run directories: a new run
    ("out-dir-empty", ["train", "--run.out_dir", ""], "run.out_dir is empty", None),
    ("out-dir-is-a-file", ["train", "--run.out_dir", "{file}"], "a_file is a file", None),
    ("out-dir-under-a-file", ["train", "--run.out_dir", "{file}/run"], "a_file is a file", None),
    ("out-dir-read-only", ["train", "--run.out_dir", "{ro}/run"], "cannot write there", None),
    ("out-dir-file-with-overwrite", ["train", "--run.out_dir", "{file}", "--run.overwrite", "true"], "is a file", None),
    ("out-dir-holds-a-run", ["train", "--run.out_dir", "{run}"], "already holds a run", None),
    # run directories: a resume
    ("resume-a-file", ["train", "--resume", "{file}"], "is a file, not a run directory", None),
    ("resume-under-a-file", ["train", "--resume", "{file}/run"], "no config.json", None),
    ("resume-read-only", ["train", "--resume", "{ro}"], "cannot write there", None),
    ("resume-into-another-run", ["train", "--resume", "{run}", "--run.out_dir", "{other}"], "is not empty", None),
    ("resume-into-a-file", ["train", "--resume", "{run}", "--run.out_dir", "{file}"], "is not empty", None),
    ("resume-with-config", ["train", "--resume", "{run}", "--config", "{missing}"], "--config cannot be used", None),
    ("resume-with-algo", ["train", "--resume", "{run}", "--algo", "ppo"], "--algo cannot be used", None),
    ("resume-updates-below-reached", ["train", "--resume", "{run}", "--train.updates", "100"], "update 160", None),
    ("resume-model-change", ["train", "--resume", "{run}", "--model.name", "small"], "--model.name", None),
    ("resume-lr-change", ["train", "--resume", "{run}", "--train.lr", "1e-3"], "--train.lr", None),
    ("resume-truncated-state", ["train", "--resume", "{truncated_state}"], "state.json", "Traceback"),
    ("resume-dangling-latest", ["train", "--resume", "{dangling}"], "update-000999", None),
    ("resume-nproc-zero", ["train", "--resume", "{run}", "--nproc", "0"], "--nproc", None),
    # config and data files
    ("config-is-a-directory", ["train", "--config", "{dir}"], "is a directory", "not found"),
    ("task-path-is-a-directory", ["train", *JSONL, "{dir}"], "is a directory", "not found"),
    ("task-path-empty-file", ["train", *JSONL, "{empty_jsonl}"], "no rows", None),
    ("section-not-a-table-with-override", ["train", "--config", "{table_toml}", "--train.updates", "3"],
     "table.toml: section [train]", None),
    ("max-tokens-beyond-context", ["train", "--gen.max_tokens", "5000"], "gen.max_tokens 5000", "allowed"),
    ("keep-checkpoints-negative", ["train", "--run.keep_checkpoints", "-1"], "run.keep_checkpoints", None),
    # tune and report
    ("tune-target-j-above-1", ["tune", "--target-j", "2"], "--target-j", None),
    ("tune-target-j-zero", ["tune", "--target-j", "0"], "--target-j", None),
    ("tune-target-j-nan", ["tune", "--target-j", "nan"], "--target-j", None),
    ("tune-config-is-a-directory", ["tune", "--config", "{dir}"], "is a directory", None),
    ("tune-workers-zero", ["tune", "--workers", "0"], "--workers", None),
    ("report-target-j-above-1", ["report", "{missing}", "--target-j", "1.5"], "--target-j", None),
    # generate and bench
    ("generate-max-tokens-zero", ["generate", "--prompt", "hi", "--max-tokens", "0"], "--max-tokens", None),
    ("generate-n-zero", ["generate", "--prompt", "hi", "--n", "0"], "--n", None),
    ("generate-model-is-a-file", ["generate", "--model", "{file}", "--prompt", "hi"], "a_file", None),
    ("bench-decode-reps-negative", ["bench", "decode", "--device", "cpu", "--reps", "-1"], "--reps", None),
    ("bench-costs-one-step", ["bench", "costs", "--steps", "1"], "--steps", None),
    ("bench-costs-modelled-without-card", ["bench", "costs", "--modelled"], "--modelled needs --device", None),
    ("bench-costs-unknown-model", ["bench", "costs", "--model", "nope"], "nope", None),
    # job settings, each named with its allowed values
    ("grpo-group-of-one", ["train", "--train.group_size", "1"], "train.group_size", None),
    ("unknown-algo", ["train", "--train.algo", "dpo"], "train.algo", None),
    ("unknown-estimator", ["train", "--train.adv_estimator", "nope"], "train.adv_estimator", None),
    ("unknown-policy-loss", ["train", "--train.policy_loss", "nope"], "train.policy_loss", None),
    ("unknown-rejection-criterion", ["train", "--train.rollout_rs", "token_k9", "--train.rollout_rs_threshold", "2"],
     "unknown rollout rejection criterion 'token_k9'", None),
    ("rollout-is-threshold-unparseable", ["train", "--train.rollout_is", "token", "--train.rollout_is_threshold",
                                          "0.5-2"], "train.rollout_is_threshold", None),
    ("rollout-is-threshold-lower-above-upper", ["train", "--train.rollout_is", "token",
                                                "--train.rollout_is_threshold", "3:2"], "lower 3.0 > upper 2.0", None),
    ("rollout-rs-threshold-lower-above-upper", ["train", "--train.rollout_rs", "seq_sum_k1",
                                                "--train.rollout_rs_threshold", "2:0.5"], "lower 2.0 > upper 0.5", None),
    ("ppo-option-on-grpo", ["train", "--train.critic_warmup", "3"], "train.critic_warmup", None),
    ("temperature-zero", ["train", "--gen.temperature", "0"], "gen.temperature", None),
    ("top-p-above-one", ["train", "--gen.top_p", "1.5"], "gen.top_p", None),
    ("negative-lr", ["train", "--train.lr", "-1"], "train.lr", None),
    ("b-gen-below-b-train", ["train", "--gen.b_gen", "8"], "gen.b_gen", None),
    ("unknown-dtype", ["train", "--model.dtype", "int8"], "model.dtype", None),
    ("unknown-model", ["train", "--model.name", "no-such-model"], "no-such-model", None),
    ("unknown-task", ["train", "--task.name", "no-such-task"], "no-such-task", None),
    ("reward-plugin-that-does-not-import", ["train", "--task.reward", "no_such_module_xyz:fn"], "no_such_module_xyz",
     None),
    ("unknown-key", ["train", "--train.no_such_key", "3"], "train.no_such_key", None),
    ("negative-micro-batch", ["train", "--train.micro_batch", "-1"], "train.micro_batch", None),
    ("eval-k-zero", ["train", "--eval.k", "0"], "eval.k", None),
    ("unknown-lr-rule", ["train", "--train.lr_rule", "cube"], "train.lr_rule", None),
    ("zero-ppo-epochs", ["train", "--train.ppo_epochs", "0"], "train.ppo_epochs", None),
    ("run-name-with-a-slash", ["train", "--run.name", "a/b"], "run.name", None),
    ("int-field-given-text", ["train", "--train.updates", "many"], "train.updates", None),
    ("generate-negative-temperature", ["generate", "--prompt", "hi", "--temperature", "-1"], "temperature", None),
    ("info-plan-missing-file", ["info", "--plan", "{missing}"], "missing", None),
    # multi-turn environments and tools
    ("env-plugin-that-does-not-import", ["train", "--env.name", "no_such_env_mod:Env"], "no_such_env_mod", None),
    ("unknown-env", ["train", "--env.name", "chess"], "unknown environment 'chess'", None),
    ("tool-plugin-that-does-not-import", ["train", "--env.name", "tools", "--env.tools", "no_such_tool_mod:fn"],
     "no_such_tool_mod", None),
    ("tool-schema-that-does-not-parse", ["train", "--env.name", "tools", "--env.tools",
                                         "tests.rl.test_tools_env:bad_schema_tool"], "schema is not JSON", None),
    ("unknown-tool", ["train", "--env.name", "tools", "--env.tools", "calculator"], "unknown tool", None),
]


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Stand-ins for what runs after validation: reaching one fails the case."""
    def reached(*a, **k):
        raise AssertionError("validation let a bad invocation through to the real work")

    import rlengine.engine
    import rlengine.rl.trainer
    import rlengine.tune
    from rlengine.benchmarks import decode

    monkeypatch.setattr(rlengine.rl.trainer.Trainer, "__init__", reached)
    monkeypatch.setattr(rlengine.engine, "LLM", reached)
    monkeypatch.setattr(rlengine.tune, "tune", reached)
    monkeypatch.setattr(decode, "run", reached)
    monkeypatch.setattr("torch.distributed.run.run", reached)


def read_only_below(monkeypatch, root: Path) -> None:
    """Writes under `root` fail with EROFS, as on a read-only filesystem (open for writing, mkdir)."""
    root = str(root)

    def under(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)).startswith(root)

    def guard(real, is_write):
        def wrapped(path, *a, **k):
            if under(path) and is_write(a, k):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
            return real(path, *a, **k)
        return wrapped

    writes_mode = lambda a, k: any(c in (a[0] if a else k.get("mode", "r")) for c in "wax+")  # noqa: E731
    writes_flags = lambda a, k: bool((a[0] if a else k.get("flags", 0)) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))  # noqa: E731
    import builtins

    monkeypatch.setattr(builtins, "open", guard(builtins.open, writes_mode))
    monkeypatch.setattr(io, "open", guard(io.open, writes_mode))
    monkeypatch.setattr(os, "open", guard(os.open, writes_flags))
    monkeypatch.setattr(os, "mkdir", guard(os.mkdir, lambda a, k: True))


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_tour_is_large_enough():
    assert len(CASES) + len(API_CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("argv,named,not_named", [pytest.param(a, n, x, id=i) for i, a, n, x in CASES])
def test_bad_input_is_one_line_exit_2_and_touches_nothing(argv, named, not_named, tmp_path, capsys, monkeypatch,
                                                          no_heavy_work):
    monkeypatch.chdir(tmp_path)            # a default run directory lands in tmp_path
    files = _files(tmp_path)
    _run_dir(Path(files["ro"]))
    read_only_below(monkeypatch, tmp_path / "ro")
    before = _snapshot(tmp_path)
    try:
        code = main([a.format(**files) for a in argv])
    except SystemExit as exc:              # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rlengine ") and " error: " in last and named in last, err
    assert not_named is None or not_named not in last, last
    after = _snapshot(tmp_path)
    created = {k for k in after.keys() - before.keys() if k == "runs" or k.startswith("runs/")}  # preflight's mkdir
    assert {k: v for k, v in after.items() if k not in created} == before


def test_max_tokens_beyond_context_is_one_line_not_a_list_of_prompts(tmp_path, capsys, monkeypatch, no_heavy_work):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--gen.max_tokens", "5000"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


# The Python API: (id, a call that must raise, the error type, text its message must contain)
def _generate_int():
    from rlengine.engine.prompts import prompt_list

    prompt_list(5)


def _jsonl_directory(tmp):
    from rlengine.rl.data.tasks import build_task

    build_task("jsonl", path=str(tmp))


def _table_with_override(tmp):
    from rlengine.rl.config import load_job_config

    (tmp / "t.toml").write_text("train = 5\n")
    load_job_config(str(tmp / "t.toml"), ["--train.updates", "3"])


def _empty_out_dir(tmp):
    from rlengine.rl.config import load_job_config

    load_job_config(None, ["--run.out_dir", " "])


def _trainer_into_a_run(tmp):
    from rlengine.rl.config import load_job_config
    from rlengine.rl.trainer import Trainer

    Trainer(load_job_config(None, ["--run.out_dir", _run_dir(tmp / "r")]))


def _trainer_resume_into_another_run(tmp):
    from rlengine.rl.config import load_job_config
    from rlengine.rl.trainer import Trainer

    src = _run_dir(tmp / "src")
    Trainer(load_job_config(None, ["--run.out_dir", _run_dir(tmp / "r")]), resume_from=src)


def _sampling_negative_temperature(tmp):
    from rlengine.engine import SamplingParams

    SamplingParams(temperature=-1.0)


API_CASES = [
    ("generate-an-int", lambda tmp: _generate_int(), TypeError, "got int"),
    ("jsonl-path-directory", _jsonl_directory, Exception, "is a directory"),
    ("toml-section-not-a-table", _table_with_override, Exception, "section [train] must be a table"),
    ("empty-out-dir", _empty_out_dir, Exception, "run.out_dir is empty"),
    ("trainer-into-a-run", _trainer_into_a_run, Exception, "already holds a run"),
    ("trainer-resume-into-another-run", _trainer_resume_into_another_run, Exception, "is not empty"),
    ("sampling-negative-temperature", _sampling_negative_temperature, ValueError, "temperature"),
]


@pytest.mark.parametrize("call,error,named", [pytest.param(c, e, n, id=i) for i, c, e, n in API_CASES])
def test_bad_python_api_call_raises_a_clear_error(call, error, named, tmp_path):
    with pytest.raises(error) as info:
        call(tmp_path)
    assert named in str(info.value).splitlines()[0]
