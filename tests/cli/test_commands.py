"""The command line: every subcommand is documented in --help, the demo job runs, bad input is one line."""

import subprocess
import sys

import pytest

from rlengine.cli import build_parser, main


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "rlengine.cli", "--help"], capture_output=True, text=True, check=True)
    sub_actions = [a for a in build_parser()._actions if a.dest == "command"][0]
    for name, parser in sub_actions.choices.items():
        assert name in out.stdout
        assert parser.description or sub_actions._name_parser_map[name].format_help()


def test_demo_runs_on_tiny_preset(capsys):
    assert main(["demo", "--max-tokens", "4"]) == 0
    assert "prompt '12+34='" in capsys.readouterr().out


def test_bad_config_input_is_one_line_error_not_a_traceback(capsys):
    assert main(["train", "run.seed=1"]) == 2
    err = capsys.readouterr().err
    assert "must look like --section.key VALUE" in err and "Traceback" not in err
    assert main(["train", "--model.nope", "3"]) == 2
    assert "unknown config key(s) model.nope" in capsys.readouterr().err


def test_resume_from_a_non_run_directory_names_it(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no config.json there" in capsys.readouterr().err


def test_info_lists_ops_and_attention_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "skinny_linear" in out and "attention backends on cpu:" in out
    assert "cpp        available" in out and "flashinfer unavailable: flashinfer needs a CUDA device" in out


def test_info_plan_takes_overrides_such_as_the_checkpoint(tmp_path, capsys):
    """`rlengine info --plan gsm8k --model.name DIR`: the packaged job needs a checkpoint; the plan is of it."""
    from rlengine.model.config import preset
    from rlengine.model import Qwen3ForCausalLM, save_pretrained

    save_pretrained(Qwen3ForCausalLM(preset("tiny")), tmp_path / "ckpt")
    argv = ["info", "--plan", "gsm8k", "--model.name", str(tmp_path / "ckpt"), "--device-memory", "8",
            "--train.b_train", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"memory plan of gsm8k ({tmp_path / 'ckpt'}, bfloat16" in out
    assert "rollout B_gen = 64" in out  # the override reached the plan


def test_generate_takes_an_explicit_tokenizer_for_a_checkpoint_without_one(tmp_path, capsys):
    """A checkpoint with a 8192-token vocabulary and no tokenizer files is refused alone (the built-in
    tokenizer does not fit it) and runs with --tokenizer DIR."""
    import dataclasses

    from rlengine.model.config import preset
    from rlengine.model import Qwen3ForCausalLM, save_pretrained
    from rlengine.model.tokenizer import Tokenizer

    save_pretrained(Qwen3ForCausalLM(dataclasses.replace(preset("tiny"), vocab_size=8192)), tmp_path / "ckpt")
    (tmp_path / "tok").mkdir()
    Tokenizer.builtin().hf.save(str(tmp_path / "tok" / "tokenizer.json"))
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--prompt", "12+3=", "--max-tokens", "3"]
    assert main(argv) == 2
    assert "--tokenizer DIR" in capsys.readouterr().err
    assert main(argv + ["--tokenizer", str(tmp_path / "tok")]) == 0
