"""Micro-benchmarks of single kernels and of the engine's host overhead, over rlengine.benchmarks.harness.

`rlengine bench NAME` runs one from an installed package (NAME: paged_decode, moe, logprob,
packed_attention, skinny_linear, host_overhead); the scripts of the same names in bench/ run the same
main(argv) from a checkout.
"""
