"""Tests of the Triton kernels (kernels/, installed as rlengine.kernels) under TRITON_INTERPRET on the CPU."""
