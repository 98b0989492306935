"""Every user error of `rlengine` ends in one line on stderr naming the problem, exit code 2, no traceback.

Each case runs in process through rlengine.cli.main and must fail while the command checks its
input (config values and names, files, data rows, checkpoints, devices, backends, benchmark
options), before any training, generation or benchmark runs: the heavy entry points are replaced
by stand-ins that fail the test if reached. Negative controls: a genuine bug (ZeroDivisionError)
still exits 1 with its traceback, and --debug shows the traceback of a user error.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlengine.cli import main
from rlengine.model.config import preset

ROOT = Path(__file__).resolve().parents[2]
GOOD_ROW = {"prompt": "1+1=", "answer": "2"}


def _jsonl(path: Path, *lines: str) -> str:
    path.write_text("\n".join([json.dumps(GOOD_ROW)] + list(lines) + [json.dumps(GOOD_ROW)] * 8) + "\n")
    return str(path)


def _checkpoint(path: Path, *, config: bool = True) -> str:
    path.mkdir()
    if config:
        (path / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    return str(path)


def _big_vocab_checkpoint(path: Path) -> str:
    """A checkpoint (tiny architecture, a 8192-token vocabulary) with weights but no tokenizer files."""
    import dataclasses

    from rlengine.model import save_pretrained
    from rlengine.model.qwen3 import Qwen3ForCausalLM

    save_pretrained(Qwen3ForCausalLM(dataclasses.replace(preset("tiny"), vocab_size=8192)), path)
    return str(path)


def _files(tmp: Path, argv: list[str]) -> dict[str, str]:
    """The bad inputs the cases name, written fresh for each case (a checkpoint only for the case using it)."""
    (tmp / "bad.toml").write_text("[train]\nlr = = 3\n")
    (tmp / "table.toml").write_text("train = 3\n")
    (tmp / "latin1.toml").write_bytes(b"[run]\nout_dir = '\xe9'\n")
    (tmp / "run").mkdir()
    (tmp / "run" / "config.json").write_text("{}")      # a run directory without checkpoints/latest that
    (tmp / "run" / "metrics.jsonl").write_text('{"update": 3}\n')  # got past update 0: nothing to resume from
    return {
        "bad_toml": str(tmp / "bad.toml"), "table_toml": str(tmp / "table.toml"),
        "latin1_toml": str(tmp / "latin1.toml"), "run": str(tmp / "run"),
        "bad_json": _jsonl(tmp / "bad_json.jsonl", '{"prompt": "2+2=", "answer": '),
        "empty_prompt": _jsonl(tmp / "empty_prompt.jsonl", json.dumps({"prompt": " ", "answer": "1"})),
        "no_answer": _jsonl(tmp / "no_answer.jsonl", json.dumps({"prompt": "2+2="})),
        "int_answer": _jsonl(tmp / "int_answer.jsonl", json.dumps({"prompt": "2+2=", "answer": 4})),
        "list_row": _jsonl(tmp / "list_row.jsonl", json.dumps(["2+2=", "4"])),
        "long_prompt": _jsonl(tmp / "long_prompt.jsonl", json.dumps({"prompt": "9" * 2000 + "=", "answer": "1"})),
        # twelve long prompts on lines 2-13: the split shuffles them, the error names line 2 first
        "long_prompts": _jsonl(tmp / "long_prompts.jsonl",
                               *[json.dumps({"prompt": "9" * 2000 + "=", "answer": "1"})] * 12),
        "big_vocab": (_big_vocab_checkpoint(tmp / "big_vocab") if any("{big_vocab}" in a for a in argv)
                      else ""),
        "no_config": _checkpoint(tmp / "no_config", config=False),
        "no_weights": _checkpoint(tmp / "no_weights"),
        "missing": str(tmp / "missing_dir"),
        "out": str(tmp / "out"),
    }


JSONL = ["--task.name", "jsonl", "--task.reward", "exact", "--task.path"]
# (id, argv with {placeholders} from _files, text the last stderr line must contain)
CASES = [
    # train: values of the wrong type
    ("lr-not-a-number", ["train", "--train.lr", "abc"], "train.lr"),
    ("updates-not-an-int", ["train", "--train.updates", "1.5"], "train.updates"),
    ("temperature-word", ["train", "--gen.temperature", "x"], "gen.temperature"),
    ("betas-scalar", ["train", "--train.betas", "1"], "train.betas"),
    ("betas-wrong-length", ["train", "--train.betas", "[0.9, 0.99, 0.999]"], "train.betas"),
    ("bool-as-int", ["train", "--run.progress", "0"], "run.progress"),
    ("lr-nan", ["train", "--train.lr", "nan"], "train.lr"),
    # train: unknown names
    ("unknown-task", ["train", "--task.name", "nope"], "nope"),
    ("unknown-reward", ["train", "--task.reward", "nope"], "nope"),
    ("unknown-preset", ["train", "--model.name", "qwen9-1t"], "qwen9-1t"),
    ("unknown-algo", ["train", "--train.algo", "a2c"], "train.algo"),
    ("unknown-algo-flag", ["train", "--algo", "a2c"], "--algo"),
    ("unknown-backend", ["train", "--gen.backend", "nope"], "gen.backend"),
    ("unknown-dtype", ["train", "--model.dtype", "int8"], "model.dtype"),
    ("unknown-section", ["train", "--nope.key", "1"], "nope"),
    ("unknown-key", ["train", "--train.nope", "1"], "train.nope"),
    ("override-without-value", ["train", "--train.lr"], "--train.lr"),
    # train: out-of-range values
    ("negative-updates", ["train", "--train.updates", "-1"], "train.updates"),
    ("zero-max-tokens", ["train", "--gen.max_tokens", "0"], "gen.max_tokens"),
    ("b-train-not-multiple-of-g", ["train", "--train.b_train", "12"], "train.b_train"),
    ("b-train-negative", ["train", "--train.b_train", "-128"], "train.b_train"),
    ("b-gen-below-b-train", ["train", "--gen.b_gen", "64"], "gen.b_gen"),
    ("too-many-additions", ["train", "--task.name", "addition", "--task.num_train", "20000"], "task.num_train"),
    ("nproc-zero", ["train", "--nproc", "0"], "--nproc"),
    ("nproc-checks-config-first", ["train", "--nproc", "2", "--train.lr", "abc"], "train.lr"),
    ("bad-profile-window", ["train", "--profile", "{out}", "--profile-window", "x"], "--profile-window"),
    # train: files
    ("missing-config-file", ["train", "--config", "missing.toml"], "missing.toml"),
    ("malformed-toml", ["train", "--config", "{bad_toml}"], "bad.toml"),
    ("section-not-a-table", ["train", "--config", "{table_toml}"], "[train]"),
    ("config-not-utf8", ["train", "--config", "{latin1_toml}"], "latin1.toml"),
    ("jsonl-without-path", ["train", "--task.name", "jsonl"], "task.path"),
    ("jsonl-missing-file", ["train", *JSONL, "missing.jsonl"], "missing.jsonl"),
    ("jsonl-malformed-line", ["train", *JSONL, "{bad_json}"], "bad_json.jsonl:2"),
    ("jsonl-empty-prompt", ["train", *JSONL, "{empty_prompt}"], "empty_prompt.jsonl:2"),
    ("jsonl-missing-answer", ["train", *JSONL, "{no_answer}"], "no_answer.jsonl:2"),
    ("jsonl-int-answer", ["train", *JSONL, "{int_answer}"], "int_answer.jsonl:2"),
    ("jsonl-row-not-object", ["train", *JSONL, "{list_row}"], "list_row.jsonl:2"),
    ("jsonl-prompt-too-long", ["train", *JSONL, "{long_prompt}"], "long_prompt.jsonl:2"),
    ("jsonl-prompts-too-long-file-order", ["train", *JSONL, "{long_prompts}"], "long_prompts.jsonl:2: prompt"),
    ("checkpoint-vocab-beyond-builtin-tokenizer", ["train", "--model.name", "{big_vocab}"], "8192"),
    ("checkpoint-missing-dir", ["train", "--model.name", "{missing}"], "missing_dir"),
    ("checkpoint-no-config-json", ["train", "--model.name", "{no_config}"], "config.json"),
    ("checkpoint-no-safetensors", ["train", "--model.name", "{no_weights}", "--run.out_dir", "{out}"], "no_weights"),
    ("resume-missing-dir", ["train", "--resume", "{missing}"], "missing_dir"),
    ("resume-without-checkpoint", ["train", "--resume", "{run}"], "checkpoints/latest"),
    ("device-cuda-without-cuda", ["train", "--model.device", "cuda"], "model.device"),
    ("device-not-a-device", ["train", "--model.device", "gpu0"], "model.device"),
    ("backend-flashinfer-unavailable", ["train", "--gen.backend", "flashinfer"], "flashinfer"),
    # bench
    ("bench-unknown", ["bench", "nope"], "nope"),
    ("bench-one-batch", ["bench", "asymmetry", "--batches", "8"], "--batches"),
    ("bench-batch-not-multiple", ["bench", "asymmetry", "--batches", "8,12"], "--group-size"),
    ("bench-batches-words", ["bench", "asymmetry", "--batches", "a,b"], "--batches"),
    ("bench-unknown-preset", ["bench", "asymmetry", "--model", "qwen9-1t", "--device", "cpu"], "qwen9-1t"),
    ("bench-decode-batches-type", ["bench", "decode", "--batches", "x"], "--batches"),
    ("bench-decode-cuda", ["bench", "decode", "--device", "cuda"], "--device"),
    ("bench-decode-backend", ["bench", "decode", "--device", "cpu", "--backend", "nope"], "nope"),
    ("bench-decode-reps", ["bench", "decode", "--device", "cpu", "--reps", "0"], "--reps"),
    ("bench-decode-window", ["bench", "decode", "--device", "cpu", "--profile-window", "x"], "--profile-window"),
    ("bench-decode-ceilings-file", ["bench", "decode", "--device", "cpu", "--ceilings", "nope.json"], "nope.json"),
    ("bench-decode-checkpoint", ["bench", "decode", "--device", "cpu", "--model", "{no_config}"], "config.json"),
    ("bench-serve-goodput", ["bench", "serve", "--device", "cpu", "--goodput", "latency:3"], "--goodput"),
    ("bench-serve-rate", ["bench", "serve", "--device", "cpu", "--request-rate", "x"], "--request-rate"),
    ("bench-serve-burstiness", ["bench", "serve", "--device", "cpu", "--burstiness", "0"], "--burstiness"),
    ("bench-ceilings-cuda", ["bench", "ceilings", "--device", "cuda"], "--device"),
    # generate
    ("generate-missing-checkpoint", ["generate", "--model", "{missing}", "--prompt", "hi"], "missing_dir"),
    ("generate-no-config-json", ["generate", "--model", "{no_config}", "--prompt", "hi"], "config.json"),
    ("generate-no-safetensors", ["generate", "--model", "{no_weights}", "--prompt", "hi"], "no_weights"),
    ("generate-cuda", ["generate", "--device", "cuda", "--prompt", "hi"], "--device"),
    ("generate-system-without-chat", ["generate", "--prompt", "hi", "--system", "be brief"], "--system"),
    ("generate-negative-temperature", ["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    ("generate-no-prompt", ["generate"], "--prompt"),
    ("generate-negative-seed", ["generate", "--prompt", "hi", "--seed", "-1"], "--seed"),
    ("generate-tokenizer-not-a-tokenizer-dir", ["generate", "--prompt", "hi", "--tokenizer", "{missing}"],
     "--tokenizer"),
    ("generate-vocab-beyond-builtin-tokenizer", ["generate", "--model", "{big_vocab}", "--prompt", "hi"], "8192"),
    # info, demo, tune, report
    ("info-plan-missing", ["info", "--plan", "missing.toml"], "missing.toml"),
    ("info-plan-malformed", ["info", "--plan", "{bad_toml}"], "bad.toml"),
    ("info-device-memory", ["info", "--plan", "{bad_toml}", "--device-memory", "-1"], "--device-memory"),
    ("info-plan-needs-model-name", ["info", "--plan", "gsm8k"], "model.name"),
    ("info-plan-model-not-a-checkpoint", ["info", "--plan", "gsm8k", "--model.name", "{no_config}"], "config.json"),
    ("info-override-without-plan", ["info", "--model.name", "{no_config}"], "--plan"),
    ("demo-unknown-preset", ["demo", "--model", "qwen9-1t"], "qwen9-1t"),
    ("demo-missing-checkpoint", ["demo", "--model", "{missing}"], "missing_dir"),
    ("demo-checkpoint-no-config", ["demo", "--model", "{no_config}"], "config.json"),
    ("demo-cuda", ["demo", "--device", "cuda"], "--device"),
    ("demo-max-tokens", ["demo", "--max-tokens", "0"], "--max-tokens"),
    ("demo-empty-prompt", ["demo", "--prompt", ""], "--prompt"),
    ("demo-dtype", ["demo", "--dtype", "int8"], "--dtype"),
    ("tune-missing-config", ["tune", "--config", "missing.toml"], "missing.toml"),
    ("tune-b-train-words", ["tune", "--b-train", "a,b"], "--b-train"),
    ("tune-zero-seeds", ["tune", "--seeds", "0"], "seeds"),
    ("report-missing-run", ["report", "{missing}", "--target-j", "0.5"], "missing_dir"),
    ("report-no-target", ["report", "{missing}"], "--target-j"),
]
CUDA_CASES = {"device-cuda-without-cuda", "bench-decode-cuda", "bench-ceilings-cuda", "demo-cuda",
              "generate-cuda"}


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Stand-ins for what runs after validation: reaching one fails the case (AssertionError is a bug)."""
    def reached(*a, **k):
        raise AssertionError("validation let a bad invocation through to the real work")

    import rlengine.model.demo
    import rlengine.engine
    import rlengine.rl.trainer
    import rlengine.tune
    from rlengine.benchmarks import asymmetry, decode, serve

    monkeypatch.setattr(rlengine.rl.trainer.Trainer, "__init__", reached)
    monkeypatch.setattr(rlengine.model.demo, "run_demo", reached)
    monkeypatch.setattr(rlengine.engine, "LLM", reached)
    monkeypatch.setattr(rlengine.tune, "tune", reached)
    monkeypatch.setattr(decode, "run", reached)
    monkeypatch.setattr(serve, "Qwen3ForCausalLM", reached)
    monkeypatch.setattr(asymmetry, "Qwen3ForCausalLM", reached)
    monkeypatch.setattr("torch.distributed.run.run", reached)   # --nproc: no rank may start


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:   # argparse's own errors (usage line, then one error line)
        return exc.code


def test_case_table_is_large_enough():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("argv,named", [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_user_error_is_one_line_exit_2_no_traceback(argv, named, tmp_path, capsys, monkeypatch, no_heavy_work,
                                                     request):
    if request.node.callspec.id in CUDA_CASES and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    monkeypatch.chdir(tmp_path)          # a default run directory lands in tmp_path, never the repo
    files = _files(tmp_path, argv)
    code = _run([a.format(**files) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert named in last, err
    assert " error: " in last and last.startswith("rlengine"), last


def test_a_bug_exits_1_with_its_traceback(tmp_path):
    """A genuine bug is not a user error: the command exits 1 and shows where it happened."""
    code = ("import sys, rlengine.cli.commands as cli\n"
            "cli._cmd_info = lambda args: 1 // 0\n"
            "sys.exit(cli.main(['info']))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" in r.stderr and "ZeroDivisionError" in r.stderr.strip().splitlines()[-1]


def test_a_bug_propagates_from_main_in_process(monkeypatch):
    import rlengine.cli.commands as cli

    monkeypatch.setattr(cli, "_cmd_info", lambda args: 1 // 0)
    with pytest.raises(ZeroDivisionError):
        cli.main(["info"])


@pytest.mark.parametrize("argv", [["--debug", "train", "--train.lr", "abc"],
                                  ["train", "--debug", "--train.lr", "abc"],
                                  ["bench", "asymmetry", "--debug", "--batches", "8"]])
def test_debug_shows_the_traceback_of_a_user_error(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ConfigError" in err
    assert err.strip().splitlines()[-1].startswith("rlengine ")      # the one-line summary still comes last


def test_multi_line_message_keeps_its_detail_above_the_summary(monkeypatch, capsys):
    """A reward failure's message carries the reward function's traceback: shown above the summary line."""
    import rlengine.cli.commands as cli
    from rlengine.rl.data.rewards import RewardError

    def fail(args):
        raise RewardError("evaluation: 3 of 4 reward calls failed; the first failure was:\n"
                          "Traceback (most recent call last):\nRuntimeError: reward backend down")

    monkeypatch.setattr(cli, "_cmd_info", fail)
    assert cli.main(["info"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == ("rlengine info: error: evaluation: 3 of 4 reward calls failed; the first failure was "
                         "(details above)")
    assert "  RuntimeError: reward backend down" in lines


def test_errors_on_other_ranks_are_not_printed(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert main(["train", "--train.lr", "abc"]) == 2
    assert capsys.readouterr().err == ""
