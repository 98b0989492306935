"""Tests of rlengine/model: parity with transformers, loader, tokenizer and chat template, attention, MoE."""
