"""The `rlengine` command line: the parser and dispatch (commands.py), and one module per command
family that needs more than a few lines (info, launch for --nproc, tune / report), plus the
launcher's watch over its ranks (rank_watch.py). The only package that parses argv."""

from rlengine.cli.commands import build_parser, main

__all__ = ["main", "build_parser"]
