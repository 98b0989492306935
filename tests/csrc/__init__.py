"""Tests of the C++ CPU ops (csrc/, loaded as torch.ops.rlengine)."""
