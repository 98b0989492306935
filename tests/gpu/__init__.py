"""GPU tier: needs a CUDA device; deselected without one (tests/conftest.py), run by tools/gpu_check.sh."""
