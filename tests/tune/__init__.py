"""Tests of rlengine/tune (rlengine tune, PAPER.md Algorithm 1)."""
