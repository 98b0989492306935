"""Tests of the command line (rlengine/cli/commands.py)."""
