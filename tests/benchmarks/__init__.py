"""Tests of rlengine/benchmarks and bench/ (harness and provenance)."""
