"""Training-state bytes (the M_weights of B_KV for an RL run) against hand counts."""

import pytest

from rlengine.analysis.memory import training_bytes_per_param, training_state_bytes
from rlengine.analysis.roofline import b_kv, kv_bytes_per_seq, param_counts
from rlengine.model.config import preset


@pytest.mark.parametrize("dtype,mode,expect", [
    ("float32", "auto", (4, 0, 8, 4)),
    ("bfloat16", "auto", (2, 4, 8, 6)),      # bf16 weights, fp32 masters/moments/grad + the bf16 grad
    ("bfloat16", "fp32", (2, 4, 8, 6)),
    ("bfloat16", "none", (2, 0, 4, 2)),
    ("float32", "fp32", (4, 4, 8, 4)),
])
def test_bytes_per_param(dtype, mode, expect):
    b = training_bytes_per_param(dtype, mode)
    assert (b.weights, b.master, b.moments, b.grads) == expect and b.total == sum(expect)


def test_training_state_enters_b_kv():
    cfg = preset("qwen3-0.6b")
    n = param_counts(cfg).total
    assert training_state_bytes(cfg, "bfloat16") == 20 * n
    assert training_state_bytes(cfg, "bfloat16", kl_reference=True) == 22 * n
    m_kv = kv_bytes_per_seq(cfg, 4096, 2)
    inference = b_kv(0.9, 80e9, 2 * n, 4e9, m_kv)
    training = b_kv(0.9, 80e9, training_state_bytes(cfg, "bfloat16"), 4e9, m_kv)
    assert training == int((0.9 * 80e9 - 20 * n - 4e9) // m_kv) and training < inference


def test_bad_inputs():
    with pytest.raises(ValueError, match="dtype"):
        training_bytes_per_param("int8")
    with pytest.raises(ValueError, match="master_weights"):
        training_bytes_per_param("bfloat16", "fp16")
