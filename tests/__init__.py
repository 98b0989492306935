"""rlengine test suite; sub-packages mirror the source tree (see README.md, Layout)."""
