"""Tests of the command line (rlengine/cli.py)."""
