"""The command line: every subcommand is documented in --help and the demo job runs."""

import subprocess
import sys

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
