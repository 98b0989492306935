"""Analysis layer against hand calculations and the paper's published numbers (docs/METHOD.md).

Table 1 is reproduced from its (P, N*, T) inputs; the PPO 39 s / 68 s measurement gives the
2.29x throughput ratio; the decode roofline of the qwen3-0.6b shape is checked against a count
of its weight shapes written out below; fits recover known parameters from noisy data.
"""

import math
import random

import pytest

from rlengine.analysis.accounting import (TargetRun, best_configuration, larger_batch_wins, throughput_ratio,
                                          time_to_target)
from rlengine.analysis.fits import (critical_generation_batch, critical_training_batch, fit_generation_time,
                                    fit_mccandlish, fit_training_time)
from rlengine.analysis.roofline import (b_kv, decode_roofline, expected_distinct_experts, kv_bytes_per_seq,
                                        param_counts, weight_bytes_per_step)
from rlengine.model.config import preset

# ---- docs/METHOD.md Table 1 -------------------------------------------------------------------
# (label, P, K*, N* in thousands of responses, T hours, r_N, q/q_128, T/T_128); G = 8.
TABLE1 = [
    ("64", 64, 200, 102.40, 13.56, 0.83, 0.73, 1.14),
    ("128", 128, 120, 122.88, 11.90, 1.00, 1.00, 1.00),
    ("256", 256, 60, 122.88, 9.54, 1.00, 1.25, 0.80),
    ("512", 512, 30, 122.88, 8.77, 1.00, 1.36, 0.74),
    ("1024", 1024, 15, 122.88, 8.42, 1.00, 1.41, 0.71),
    ("2048", 2048, 12, 196.61, 14.68, 1.60, 1.30, 1.23),
    ("4096", 4096, 6, 196.61, 14.00, 1.60, 1.36, 1.18),
    ("256 fixed", 256, 100, 204.80, 16.93, 1.67, 1.17, 1.42),
]


def table1_rows():
    runs = [TargetRun(batch=p, n_star=n, t=t, label=label) for label, p, _, n, t, *_ in TABLE1]
    return time_to_target(runs, reference="128")


def test_table1_n_star_is_p_g_k():
    for _, p, k, n, *_ in TABLE1:
        assert p * 8 * k / 1000 == pytest.approx(n, abs=0.005)


def test_table1_reproduced():
    rows = table1_rows()
    for row, (label, _, _, _, _, r_n, q_ratio, t_norm) in zip(rows, TABLE1):
        assert row.run.name == label
        assert round(row.r_n, 2) == r_n, label
        assert round(row.q_ratio, 2) == q_ratio, label
        assert round(row.t_norm, 2) == t_norm, label
        # hand-computed: T/T_ref is the time ratio, e.g. 8.42 / 11.90 = 0.7076
        assert row.t_norm == pytest.approx(row.run.t / 11.90)
        # the decision rule agrees with the clock: q2/q1 > r_N exactly when T2 < T_ref
        assert row.wins == (row.run.t < 11.90)
    assert rows[4].t_norm == pytest.approx(8.42 / 11.90) and round(8.42 / 11.90, 2) == 0.71
    best = best_configuration(rows)
    assert best.run.batch == 1024 and round(best.t_norm, 2) == 0.71


def test_decision_rule():
    assert larger_batch_wins(1.41, 1.00)
    assert not larger_batch_wins(1.30, 1.60)      # P = 2048: throughput gain below the sample penalty
    assert not larger_batch_wins(1.60, 1.60)      # equal: same time, not faster
    with pytest.raises(ValueError):
        larger_batch_wins(0.0, 1.0)


def test_time_to_target_errors():
    with pytest.raises(ValueError, match="no runs"):
        time_to_target([], reference="128")
    with pytest.raises(ValueError, match="reference"):
        time_to_target([TargetRun(batch=64, n_star=1, t=1)], reference="128")
    with pytest.raises(ValueError, match="unique"):
        time_to_target([TargetRun(batch=64, n_star=1, t=1), TargetRun(batch=64, n_star=2, t=1)], reference="64")
    with pytest.raises(ValueError, match="T > 0"):
        time_to_target([TargetRun(batch=64, n_star=1, t=0)], reference="64")


# ---- generation-side measurements -------------------------------------------------------
def test_ppo_throughput_ratio_and_fit():
    # B_train 256 -> 1024: 4x the responses in 68 s instead of 39 s.
    ratio = throughput_ratio(256, 39.0, 1024, 68.0)
    assert ratio == pytest.approx(4 * 39 / 68) and round(ratio, 2) == 2.29
    fit = fit_generation_time([256, 1024], [39.0, 68.0])
    # by hand: d1 = (68 - 39) / (1024 - 256) = 29/768 s per response; d0 = 39 - 256 * 29/768 = 29.333 s
    assert fit.d1 == pytest.approx(29 / 768)
    assert fit.d0 == pytest.approx(39 - 256 * 29 / 768) and fit.d0 == pytest.approx(29.3333, abs=1e-4)
    assert fit.r2 == pytest.approx(1.0)


def test_grpo_time_ratios_give_throughput_ratios():
    # P 128 -> 256 takes 1.53x the time for 2x the responses; 128 -> 512 takes 2.93x for 4x.
    assert throughput_ratio(1, 1.0, 2, 1.53) == pytest.approx(1.31, abs=0.005)
    assert throughput_ratio(1, 1.0, 4, 2.93) == pytest.approx(1.36, abs=0.01)  # paper rounds its inputs
    with pytest.raises(ValueError, match="t2"):
        throughput_ratio(1, 1.0, 4, 0.0)


# ---- decode roofline: qwen3-0.6b by hand -------------------------------------------------
# C=1024, H=16, Hkv=8, D=128, L=28, F=3072, V=151936, tied embeddings.
#   per layer: q 1024*2048 = 2,097,152; k, v 1024*1024 = 1,048,576 each; o 2,097,152
#              -> projections 6,291,456; q/k norms 2*128 = 256; two RMSNorms 2*1024 = 2048;
#              MLP 3*1024*3072 = 9,437,184; layer total 15,730,944
#   28 layers 440,466,432 + final norm 1024 + embedding 151936*1024 = 155,582,464 -> 596,049,920
PROJ, QK_NORM, LN, MLP = 6_291_456, 256, 2048, 9_437_184
LAYERS = 28 * (PROJ + QK_NORM + LN + MLP)
EMBED = 151_936 * 1024
STREAMED = LAYERS + 1024 + EMBED                 # all layers + final norm + LM head (= embedding, tied)
KV_PER_TOKEN = 2 * 28 * 8 * 128 * 2              # K and V, all layers, bf16: 114,688 bytes
F_TOK_1K = 2 * (28 * (PROJ + MLP) + EMBED) + 4 * 28 * 16 * 128 * 1024  # 1,426,849,792
W_HBM, F_EFF = 1.0e12, 1.0e14                    # round ceilings so the arithmetic is checkable


def test_param_count_qwen3_06b():
    p = param_counts(preset("qwen3-0.6b"))
    assert LAYERS == 440_466_432 and p.total == 596_049_920 == LAYERS + 1024 + EMBED
    assert p.active_matmul == 28 * (PROJ + MLP) + EMBED == 595_984_384
    assert F_TOK_1K == 1_426_849_792


@pytest.mark.parametrize("b_act", [1, 8, 64, 256])
def test_roofline_qwen3_06b_1k_context(b_act):
    cfg = preset("qwen3-0.6b")
    r = decode_roofline(cfg, b_act=b_act, context_len=1024, bandwidth=W_HBM, flops=F_EFF)
    m_w = 2 * (STREAMED + b_act * 1024)          # bf16 weights + the B looked-up embedding rows
    m_u = KV_PER_TOKEN * 1025                    # read 1024 cached tokens, write 1
    assert r.weight_bytes == m_w and r.seq_bytes == m_u and r.flops_per_token == F_TOK_1K
    t_mem = (m_w + b_act * m_u) / W_HBM
    t_cmp = b_act * F_TOK_1K / F_EFF
    assert r.t_memory == pytest.approx(t_mem, rel=1e-12) and r.t_compute == pytest.approx(t_cmp, rel=1e-12)
    assert r.t_dec == pytest.approx(t_mem, rel=1e-12)          # bandwidth-bound at every B here
    assert r.tokens_per_s == pytest.approx(b_act / t_mem, rel=1e-12)
    assert r.arithmetic_intensity == pytest.approx(b_act * F_TOK_1K / (m_w + b_act * m_u), rel=1e-12)
    assert r.ridge == 100.0 and r.bandwidth_bound
    if b_act == 1:
        # 1,192,101,888 weight bytes + 117,555,200 KV bytes over 1 TB/s = 1.3097 ms -> 763.6 tokens/s
        assert r.t_dec * 1e3 == pytest.approx(1.309657088, rel=1e-9)
        assert r.tokens_per_s == pytest.approx(763.56, abs=0.01)


def test_roofline_compute_bound_when_flops_are_scarce():
    r = decode_roofline(preset("qwen3-0.6b"), b_act=256, context_len=1024, bandwidth=W_HBM, flops=1e12)
    assert not r.bandwidth_bound and r.t_dec == r.t_compute == pytest.approx(256 * F_TOK_1K / 1e12)


def test_roofline_moe_streams_expected_distinct_experts():
    cfg = preset("tiny-moe")                     # C=64, H=4, Hkv=2, D=16, L=2, V=256, E=8, K=2, F_moe=32
    proj = 64 * 64 + 2 * 64 * 32 + 64 * 64       # q, k+v, o = 12,288
    per_layer = proj + 2 * 16 + 2 * 64 + 64 * 8  # + q/k norms, RMSNorms, router
    expert = 3 * 64 * 32
    dense_part = 2 * per_layer + 64 + 256 * 64   # + final norm + LM head
    assert expected_distinct_experts(8, 2, 1) == pytest.approx(2.0)
    assert expected_distinct_experts(8, 2, 3) == pytest.approx(8 * (1 - 0.75**3))
    assert expected_distinct_experts(8, 8, 1) == pytest.approx(8.0)      # K = E: every expert
    assert expected_distinct_experts(8, 2, 10_000) == pytest.approx(8.0)
    for b in (1, 3, 64):
        expected = dense_part + b * 64 + 2 * expected_distinct_experts(8, 2, b) * expert
        assert weight_bytes_per_step(cfg, b, weight_bytes=1) == pytest.approx(expected)
    with pytest.raises(ValueError):
        expected_distinct_experts(8, 9, 1)


def test_roofline_errors():
    cfg = preset("tiny")
    with pytest.raises(ValueError, match="b_act"):
        decode_roofline(cfg, b_act=0, context_len=10, bandwidth=1.0, flops=1.0)
    with pytest.raises(ValueError, match="positive"):
        decode_roofline(cfg, b_act=1, context_len=10, bandwidth=0.0, flops=1.0)


# ---- KV feasibility ---------------------------------------------------------------------
def test_b_kv_worked_example():
    # qwen3-0.6b, bf16, 8K context on an 80 GB device with 90% usable and 4 GB runtime reserve:
    # m_KV = 114,688 B/token * 8192 = 939,524,096 B; free = 72e9 - 1,192,099,840 - 4e9 = 66,807,900,160 B
    # B_KV = floor(66,807,900,160 / 939,524,096) = floor(71.108) = 71
    cfg = preset("qwen3-0.6b")
    m_kv = kv_bytes_per_seq(cfg, 8192, 2)
    assert m_kv == 939_524_096
    assert b_kv(0.9, 80e9, 2 * 596_049_920, 4e9, m_kv) == 71
    assert b_kv(0.9, 80e9, 70e9, 4e9, m_kv) == 0  # weights and runtime leave nothing for KV


@pytest.mark.parametrize("args, field", [
    ((0.0, 80e9, 1e9, 0.0, 1e6), "alpha"), ((1.5, 80e9, 1e9, 0.0, 1e6), "alpha"),
    ((0.9, 0.0, 1e9, 0.0, 1e6), "c_mem"), ((0.9, 80e9, -1.0, 0.0, 1e6), "m_weights"),
    ((0.9, 80e9, 1e9, -1.0, 1e6), "m_runtime"), ((0.9, 80e9, 1e9, 0.0, 0.0), "m_kv"),
])
def test_b_kv_errors(args, field):
    with pytest.raises(ValueError, match=field):
        b_kv(*args)


# ---- fits -------------------------------------------------------------------------------
def test_fits_recover_known_parameters_from_noisy_data():
    rng = random.Random(0)
    batches = [64, 128, 256, 512, 1024, 2048] * 3
    t_gen = [30.0 + 0.04 * b + rng.gauss(0, 0.5) for b in batches]
    fit = fit_generation_time(batches, t_gen)
    assert fit.d0 == pytest.approx(30.0, abs=0.6) and fit.d1 == pytest.approx(0.04, rel=0.02)
    assert 0.99 < fit.r2 <= 1.0
    t_train = [0.4 * b * (1 + rng.gauss(0, 0.02)) for b in batches]
    g = fit_training_time(batches, t_train)
    assert g.gamma == pytest.approx(0.4, rel=0.01) and g.r2 > 0.99
    assert fit_training_time([100], [40.0]).gamma == 0.4  # one batch size determines gamma alone


def test_mccandlish_fit_and_critical_training_batch():
    batches = [64, 128, 256, 512, 1024, 2048, 4096]
    k_star = [10 * (1 + 256 / b) for b in batches]
    f = fit_mccandlish(batches, k_star)
    assert f.k_min == pytest.approx(10) and f.b_crit == pytest.approx(256) and f.r2 == pytest.approx(1)
    # 1/K* at 256 is 1/20 >= half the best 1/10.625; at 128 it is 1/30 < 1/21.25
    assert critical_training_batch(batches, k_star) == 256
    # Table 1 K*: best efficiency 1/6 at P = 4096; P = 2048 sits exactly on half of it (1/12)
    assert critical_training_batch([r[1] for r in TABLE1[:7]], [r[2] for r in TABLE1[:7]]) == 2048


def test_critical_generation_batch_boundaries():
    b = [1, 2, 4, 8, 16]
    q = [10.0, 18.0, 27.0, 30.0, 30.3]
    assert critical_generation_batch(b, q, 0.1) == 8            # 27 < 0.9 * 30.3 = 27.27 <= 30
    assert critical_generation_batch(b[::-1], q[::-1], 0.1) == 8  # order does not matter
    assert critical_generation_batch([1, 2, 3], [50.0, 90.0, 100.0], 0.1) == 2   # exactly on the threshold
    assert critical_generation_batch([1, 2, 3], [50.0, 89.999, 100.0], 0.1) == 3  # just below it
    assert critical_generation_batch(b, q, 1e-9) == 16            # tiny tolerance: only the maximum
    assert critical_generation_batch(b, q, 0.999) == 1            # loose tolerance: the smallest batch


@pytest.mark.parametrize("fn", [fit_generation_time, fit_mccandlish, critical_training_batch,
                                lambda b, v: critical_generation_batch(b, v, 0.1)])
def test_sweep_errors(fn):
    with pytest.raises(ValueError, match="empty"):
        fn([], [])
    with pytest.raises(ValueError, match="distinct"):
        fn([256], [39.0])
    with pytest.raises(ValueError, match="distinct"):
        fn([256, 256], [39.0, 40.0])
    with pytest.raises(ValueError, match="> 0"):
        fn([256, 1024], [39.0, 0.0])
    with pytest.raises(ValueError, match="> 0"):
        fn([256, 1024], [-1.0, 68.0])
    with pytest.raises(ValueError, match="measurements"):
        fn([256, 1024], [39.0])


def test_fit_training_time_errors():
    with pytest.raises(ValueError, match="empty"):
        fit_training_time([], [])
    with pytest.raises(ValueError, match="> 0"):
        fit_training_time([128], [0.0])


@pytest.mark.parametrize("delta", [0.0, 1.0, -0.1, 1.5, math.nan])
def test_critical_generation_batch_delta_outside_unit_interval(delta):
    with pytest.raises(ValueError, match="delta"):
        critical_generation_batch([1, 2], [1.0, 2.0], delta)


# ---- measured ceilings --------------------------------------------------------------------
def test_ceilings_run_writes_json(tmp_path, capsys):
    import json

    from rlengine.analysis.ceilings import run

    path = run("cpu", tmp_path, reps=1)
    data = json.loads(path.read_text())
    c = data["ceilings"]
    assert c["bandwidth_bytes_per_s"] > 0 and set(c["flops_per_s"]) == {"float32", "bfloat16"}
    assert all(f > 0 for f in c["flops_per_s"].values()) and len(data["rows"]) == 3
    assert "GB/s" in capsys.readouterr().out
    # the measured ceilings plug straight into the roofline
    r = decode_roofline(preset("tiny"), b_act=4, context_len=64, bandwidth=c["bandwidth_bytes_per_s"],
                        flops=c["flops_per_s"]["float32"], weight_bytes=4, kv_bytes=4)
    assert r.t_dec > 0
