"""Tests of tools/ (plot scripts)."""
