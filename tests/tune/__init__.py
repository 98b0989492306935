"""Tests of rlengine/tune (rlengine tune, docs/METHOD.md Algorithm 1)."""
