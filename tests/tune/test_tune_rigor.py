"""rlengine.tune's statistics and rules against hand-computed values: paired log-ratio intervals, the
isotonic J* crossing, censoring, the B_gen ladder's order and stopping rule, inconclusive gains, the
implied policy lag, the LR retune bracket, `--predict` (Eq. 5) and the refused `--b-gen` values.
Synthetic curves only (no training): each test runs in well under a second.
"""

import json
import math
import tomllib

import pytest

from rlengine.cli import build_parser, main
from rlengine.model.config import preset
from rlengine.plan.specs import PlanChange
from rlengine.tune import TuneSpec, tune
from rlengine.tune.ladder import implied_max_lag, probe_order, probe_window, run_ladder, stop_after
from rlengine.tune.predict import predict_knee
from rlengine.tune.retune import censored_mean_n, censored_r_n
from rlengine.tune.runner import plan_config
from rlengine.tune.stats import isotonic, monotone_crossing, paired_log_ratio, t975
from rlengine.tune.stage_records import CandidateStats, RunCurve, RunPlan, TargetHit
from tests.tune.test_tune import D0, D1, GAMMA, JOB, TARGET, spec, synthetic_runner


def test_paired_log_ratio_interval_by_hand():
    ci = paired_log_ratio([12.0, 9.0, 10.0], [10.0, 10.0, 10.0])
    d = [math.log(1.2), math.log(0.9), 0.0]                      # 0.18232, -0.10536, 0
    m = sum(d) / 3                                                # 0.025654
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 2)              # 0.14555
    half = 4.303 * sd / math.sqrt(3)                              # t_{0.975, 2} = 4.303
    assert ci.ratio == pytest.approx(math.exp(m)) and ci.ratio == pytest.approx(1.02599, abs=1e-5)
    assert (ci.lo, ci.hi) == pytest.approx((math.exp(m - half), math.exp(m + half)))
    assert (ci.lo, ci.hi) == pytest.approx((0.7147, 1.4729), abs=2e-4)
    assert ci.resolvable == pytest.approx(math.exp(half) - 1) and ci.k == 3
    # log ratios make it symmetric: swapping a and b inverts every bound
    inv = paired_log_ratio([10.0, 10.0, 10.0], [12.0, 9.0, 10.0])
    assert (inv.lo, inv.hi) == pytest.approx((1 / ci.hi, 1 / ci.lo))
    one = paired_log_ratio([2.0], [1.0])
    assert one.ratio == 2.0 and one.lo is None and one.resolvable is None
    assert t975(1) == 12.706 and t975(30) == 2.042 and 1.96 < t975(200) < 1.975
    with pytest.raises(ValueError, match="pair"):
        paired_log_ratio([1.0, 2.0], [1.0])


def test_isotonic_pool_adjacent_violators_and_monotone_crossing():
    assert isotonic([0.1, 0.3, 0.2, 0.5]) == pytest.approx([0.1, 0.25, 0.25, 0.5])
    assert isotonic([3.0, 1.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert isotonic([1.0, 0.0], w=[3.0, 1.0]) == pytest.approx([0.75, 0.75])
    n, j = [0, 10, 20, 30], [0.1, 0.7, 0.5, 0.9]
    # fit [0.1, 0.6, 0.6, 0.9]: J* = 0.6 is met at N = 10 (the raw first crossing, 8.33, lands early)
    assert monotone_crossing(n, j, 0.6) == pytest.approx(10.0)
    assert monotone_crossing(n, j, 0.65) == pytest.approx(20 + 0.05 / 0.3 * 10)
    # one lucky evaluation above J* that the fit pools away is not a crossing: censored
    assert monotone_crossing([0, 10, 20], [0.1, 0.62, 0.5], 0.6) is None
    assert monotone_crossing([0, 10], [0.7, 0.8], 0.6) == 0.0


def _cand(label, b, ns, budget=50000.0, stage="stage1"):
    hits = tuple(TargetHit(reached=n is not None, n_star=n, t_star=n and n / 100, k_star=n and n / b) for n in ns)
    return CandidateStats(label=label, stage=stage, b_train=b, b_gen=b, lr=1e-3, lr_rule="sqrt",
                          seeds=tuple(range(len(ns))), hits=hits, n_budget=budget, grad_norm=(1.0,) * len(ns),
                          q_run=(1.0,) * len(ns))


def test_censoring_is_the_same_everywhere():
    from rlengine.tune.table import build_rows

    ref, big = _cand("128", 128, (10000, 20000, 40000)), _cand("512", 512, (15000, None, 60000))
    # the miss counts at the budget 50000, in the retune trigger and in the table's lower bound alike
    assert censored_mean_n(big) == pytest.approx((15000 + 50000 + 60000) / 3)
    assert censored_r_n(big, ref) == pytest.approx((1.5 * 2.5 * 1.5) ** (1 / 3))
    rows = {r.label: r for r in build_rows([ref, big], "128")}
    assert rows["512"].r_n_lower == pytest.approx((15000 + 50000 + 60000) / 70000)
    assert rows["512"].censored == 1 and rows["512"].why.startswith("censored: 1/3")
    assert rows["512"].r_n_ci["k"] == 2                 # intervals pair only seeds both reached
    assert rows["512"].r_n_ci["ratio"] == pytest.approx(1.5)


def test_probe_order_interleaves_neighbours():
    assert probe_order(4) == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (3, 0), (2, 1), (3, 1)]
    assert probe_order(1) == [(0, 0), (0, 1)]


def _fake_probe(q_of):
    """A runner whose probe at B_gen g, repeat r has q = q_of(g, r): t_gen + t_train per update = B_train / q."""
    calls = []

    def run(plan):
        g, rep = plan.label, int(plan.name.rsplit("r", 1)[1])
        calls.append((g, rep))
        dt = 32 / q_of(g, rep)
        u = 6
        return RunCurve(name=plan.name, label="x", stage="probe", seed=0, b_train=32, b_gen=g, lr=1e-3,
                        lr_rule="sqrt", eval_n=(0.0,), eval_j=(0.0,), eval_t=(0.0,),
                        update_n=tuple(32.0 * i for i in range(1, u + 1)),
                        update_t=tuple(dt * i for i in range(1, u + 1)), update_t_gen=(dt / 2,) * u,
                        grad_norm=(1.0,) * u, policy_lag=(0.0,) * u, stopped_at_target=False)
    return run, calls


def _ladder(values, q_of, delta=0.1):
    run, calls = _fake_probe(q_of)
    sw = run_ladder(values, lambda g, r: RunPlan(name=f"p-g{g}-r{r}", stage="probe", label=g, seed=0,
                                                 change=PlanChange(), target_j=None),
                    run, b_train=32, label="32", delta=delta, window_for=lambda g: (1, 6), b_kv=0,
                    b_kv_source="", capped=False)
    return sw, calls


def test_ladder_stops_after_two_points_below_the_bar():
    q = {32: 100, 64: 200, 128: 300, 256: 250, 512: 200, 1024: 100, 2048: 50}
    sw, calls = _ladder(list(q), lambda g, r: q[g])
    # bar 0.9 * 300 = 270: 256 and 512 fall below -> stop; 1024, already started, gets its second probe
    assert sw.stop_reason == "plateau" and sw.critical_b_gen == 128
    assert [p.b_gen for p in sw.points] == [32, 64, 128, 256, 512, 1024]
    assert calls == [(32, 0), (64, 0), (32, 1), (128, 0), (64, 1), (256, 0), (128, 1), (512, 0), (256, 1),
                     (1024, 0), (512, 1), (1024, 1)]
    assert all(len(p.q_reps) == 2 for p in sw.points)
    # one dip is not a stop (the old first-non-gain rule stopped at 128 here)
    q2 = {32: 100, 64: 200, 128: 150, 256: 300, 512: 300}
    sw2, _ = _ladder(list(q2), lambda g, r: q2[g])
    assert sw2.stop_reason == "ladder end" and sw2.critical_b_gen == 256
    assert stop_after([100, 300, 260, 265], 0.1) and not stop_after([100, 300, 260, 280], 0.1)


def test_gain_within_twice_the_repeat_spread_is_inconclusive():
    reps = {32: (100, 120), 64: (115, 125)}
    sw, _ = _ladder([32, 64], lambda g, r: reps[g][r])
    p0, p1 = sw.points
    assert p0.spread == pytest.approx(20 / 110) and p1.spread == pytest.approx(10 / 120)
    # 110 >= 0.9 x 120: the rule's critical B_gen is the coupled one, but the best point's gain
    # 120 / 110 - 1 = 9% is under 2 x 18%: inconclusive, not a plateau
    assert sw.critical_b_gen == 32 and sw.verdict == "inconclusive" and not sw.plateau
    # a critical point above coupled whose gain (155 / 120 - 1 = 29%) is under 2 x 33%: inconclusive too
    sw1, _ = _ladder([32, 64], lambda g, r: {32: (100, 140), 64: (150, 160)}[g][r])
    assert sw1.critical_b_gen == 64 and sw1.verdict == "inconclusive"
    sw2, _ = _ladder([32, 64], lambda g, r: {32: (100, 102), 64: (150, 152)}[g][r])
    assert sw2.verdict == "gain" and sw2.critical_b_gen == 64
    sw3, _ = _ladder([32, 64], lambda g, r: {32: (100, 101), 64: (104, 105)}[g][r])
    assert sw3.verdict == "no gain" and sw3.critical_b_gen == 32            # a real, quiet plateau


def test_implied_lag_is_set_on_async_probes_and_the_window_skips_the_fill(tmp_path):
    assert implied_max_lag(32, 32) == 2 and implied_max_lag(128, 32) == 5 and implied_max_lag(100, 32) == 5
    assert probe_window(32, 32, 2, 12) == (2, 12) and probe_window(256, 32, 2, 12) == (8, 18)
    log = []
    tune(spec(b_train=(128,), seeds=(0,), fixed_lr=False, confirm_seeds=0), tmp_path,
         runner=synthetic_runner(log), log=lambda s: None)
    probes = [dict(p.overrides) for p in log if p.stage == "probe"]
    for over in probes:
        if over["gen.b_gen"] > over["train.b_train"]:
            assert over["gen.max_lag"] == implied_max_lag(over["gen.b_gen"], over["train.b_train"])
        else:
            assert "gen.max_lag" not in over               # coupled: the job's own setting
    assert {o["gen.b_gen"] for o in probes} == {128, 256, 512, 1024}


def lr_runner(log):
    """The synthetic runner, but B_train 512 needs fewer samples at eta x sqrt2 (S 16000 -> 9000) and
    many more at eta x 1/sqrt2 (S 16000 -> 40000: N* 18000, past its bracket cap)."""
    inner = synthetic_runner(log)

    def run(plan):
        curve = inner(plan)
        cfg = plan_config(JOB, plan, "unused")
        eta = cfg.train.lr_effective
        if cfg.train.b_train == 512 and plan.stage != "control" and (eta > 0.0031 or eta < 0.0029):
            scale = (9000.0 if eta > 0.0031 else 40000.0) * (1.1 if cfg.gen.b_gen > 512 else 1.0)
            import dataclasses

            j = tuple(0.1 + n / scale for n in curve.eval_n)
            return dataclasses.replace(curve, eval_j=j)
        return curve
    return run


def test_lr_retune_keeps_the_best_of_the_bracket(tmp_path):
    s = spec(b_train=(128, 512), fixed_lr=False, confirm_seeds=0, stop_at_target=False)
    log = []
    result = tune(s, tmp_path, runner=lr_runner(log), log=lambda x: None)
    rows = {r.label: r for r in result.rows}
    # a bracket run stops at min(2 x its seed's x1 N*, N*_ref x q_free / q_ref): x1 N* = 0.45 x 16000;
    # over the window (updates 2-6) q_free(512) = 1 / GAMMA and q_ref = 128 / (D0 + D1 128 + GAMMA 128)
    win = 0.45 * 8000 * (1 / GAMMA) / (128 / (D0 + D1 * 128 + GAMMA * 128))     # 8212.5 < 2 x 7200
    bracket = [plan_config(JOB, p, "x").train.updates for p in log if p.stage == "retune"]
    assert bracket == [math.ceil(min(2 * 7200, win) / 512)] * 4 == [17] * 4
    # x1/sqrt2 needs N* 18000 > its cap: censored where its runs stopped (17 x 512), on both seeds
    assert rows["512 lr x1/sqrt2"].reached == "0/2" and rows["512 lr x1/sqrt2"].censored == 2
    assert any("x1/sqrt2: N* 8704 (0/2)" in n for n in result.notes)
    assert rows["512"].lr == pytest.approx(1.5e-3 * 2 * math.sqrt(2))          # sqrt rule x sqrt2
    assert rows["512"].n_star == pytest.approx(0.45 * 9000)
    assert dict(result.stage1.lr_scales)[512] == pytest.approx(math.sqrt(2))
    assert "512 lr x1" in rows and not rows["512 lr x1"].eligible
    assert rows["512 lr x1"].n_star == pytest.approx(0.45 * 16000)
    assert any("retuned: eta xsqrt2 kept" in n for n in result.notes)
    # the reference is never retuned; the chosen TOML carries the LR the configuration ran with
    assert not any(r.label.startswith("128 lr") for r in result.rows)
    toml = tomllib.loads((tmp_path / "chosen.toml").read_text())
    chosen = rows[result.chosen]
    assert toml["train"]["lr"] == pytest.approx(chosen.lr) and toml["train"]["b0"] == 0
    assert toml["train"]["prompts_per_step"] * toml["train"]["group_size"] == toml["train"]["b_train"]


def test_predict_knee_by_hand():
    """Eq. 5 on the tiny preset (fp32, S = 32) with W = 1e9 B/s, F = 1e10 FLOP/s, written out."""
    m_w0 = (24640 + 320 + 49152 + 16384) * 4          # attention + norms + MLP + LM head, 4 bytes each
    per_seq = 64 * 4 + 2 * 2 * 2 * 16 * 33 * 4       # an embedding row + m_u (K and V of 33 tokens, 2 layers)
    f_tok = 2 * (24576 + 49152 + 16384) + 4 * 2 * 4 * 16 * 32
    w, f = 1e9, 1e10
    q_max = f / f_tok                                  # compute-bound at B = 4096
    bar = 0.9 * q_max
    # bandwidth-bound q = B W / (M_W0 + B per_seq) >= bar  <=>  B >= bar M_W0 / (W - bar per_seq)
    want = math.ceil(bar * m_w0 / (w - bar * per_seq))
    p = predict_knee(preset("tiny"), {"bandwidth_bytes_per_s": w, "flops_per_s": {"float32": f}},
                     context_len=32, dtype="float32", delta=0.1, b_max=4096)
    assert want == 78 and p.critical_b == want
    assert p.flops_per_token == f_tok and p.weight_bytes == m_w0 + 64 * 4
    assert p.ridge_b == pytest.approx(m_w0 / (f_tok * w / f - per_seq))       # 144.3
    assert p.q_tok_max == pytest.approx(q_max)


def test_predict_knee_with_measured_step_costs_by_hand():
    """With step costs, q(B) = 1 / (L (d0 / B + d1) + t_train) where the engine's d0 + d1 B exceeds Eq. 5's
    t_dec (ceilings so high the roofline never binds): q >= 0.9 q(4096) <=> B >= L d0 / (1 / bar - L d1 - t_train)."""
    from rlengine.tune.step_costs import StepCosts

    d0, d1, L, t_train, b_max = 0.65e-3, 18e-6, 25, 1.116e-3, 4096
    costs = StepCosts(d0=d0, d1=d1, train_per_response=t_train, response_len=L, batches=(16, 128),
                      step_s=(d0 + 16 * d1, d0 + 128 * d1))
    q_top = 1 / (L * (d0 / b_max + d1) + t_train)
    want = math.ceil(L * d0 / (1 / (0.9 * q_top) - L * d1 - t_train))
    p = predict_knee(preset("tiny"), {"bandwidth_bytes_per_s": 1e15, "flops_per_s": {"float32": 1e18}},
                     context_len=32, dtype="float32", delta=0.1, b_max=b_max, costs=costs)
    assert want == 92 and p.critical_b_q == want and p.q_max == pytest.approx(q_top)
    plain = predict_knee(preset("tiny"), {"bandwidth_bytes_per_s": 1e15, "flops_per_s": {"float32": 1e18}},
                         context_len=32, dtype="float32", delta=0.1, b_max=b_max)
    assert p.costs["d0"] == d0 and p.critical_b == plain.critical_b and plain.costs is None
    # where Eq. 5's bound is the larger (slow ceilings), it sets t_dec and the knee moves with it
    slow = predict_knee(preset("tiny"), {"bandwidth_bytes_per_s": 1e9, "flops_per_s": {"float32": 1e10}},
                        context_len=32, dtype="float32", delta=0.1, b_max=b_max, costs=costs)
    assert slow.critical_b_q != want


def test_measured_step_costs_fit_the_two_decode_batches():
    """d0 + d1 B passes through both measured step times; the learner's time per response is positive."""
    from rlengine.rl.config import load_job_config
    from rlengine.tune.step_costs import measure_step_costs

    job = load_job_config("rlengine/configs/grpo_long.toml").to_dict()
    c = measure_step_costs(job, batches=(4, 16), steps=4)
    small, large = c.step_s
    assert c.d0 + c.d1 * 4 == pytest.approx(small) or c.d1 == 0.0
    assert c.d1 == 0.0 or c.d0 + c.d1 * 16 == pytest.approx(large)
    assert c.train_per_response > 0 and c.response_len == job["gen"]["max_tokens"]


def test_cli_refuses_bad_b_gen_and_takes_overrides(tmp_path, capsys):
    for bad in ("1,2", "128", "64,256"):               # the job's B_train is 128
        assert main(["tune", "--config", "grpo", "--b-gen", bad, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "<= the job's B_train 128" in err[0]
    assert not (tmp_path / "x").exists()                 # refused before any run
    ceil = tmp_path / "ceilings.json"
    ceil.write_text(json.dumps({"ceilings": {"bandwidth_bytes_per_s": 1e9, "flops_per_s": {"float32": 1e10}}}))
    assert main(["tune", "--config", "grpo", "--train.lr", "1e-3", "--predict", str(ceil),
                 "--predict-context", "32"]) == 0
    assert "critical B_gen 78" in capsys.readouterr().out
    assert main(["tune", "--config", "grpo", "--train.nope", "1", "--predict", str(ceil)]) == 2
    args, _ = build_parser().parse_known_args(["tune", "--probe-updates", "7", "--threads", "1"])
    assert args.probe_updates == 7 and args.threads == 1
    with pytest.raises(ValueError, match="threads"):
        TuneSpec(job=JOB, target_j=TARGET, b_train=(128,), threads=0)


def test_the_report_header_names_the_cpu_it_ran_on():
    from types import SimpleNamespace

    from rlengine.telemetry.provenance import cpu_isa, cpu_model
    from rlengine.tune.pipeline import run_header
    from rlengine.tune.report_md import header_markdown

    curve = SimpleNamespace(load=(1.5, 2.5), cpu_s=9.0, wall_s=10.0, clock="cpu")
    header = run_header(SimpleNamespace(threads=1, workers=2, clock="auto"), SimpleNamespace(curves=[curve, curve]))
    assert header["host"] == cpu_model() and header["cpu_isa"] == cpu_isa()
    assert header["load_min"] == 1.5 and header["load_max"] == 2.5 and header["cpu_per_wall"] == 0.9
    text = header_markdown(SimpleNamespace(header=header))
    assert "2 runs side by side, one process each" in text
    assert f"host {cpu_model()} (" in text and "load average over the runs 1.50 to 2.50" in text
    assert "x86_64" not in text or "x86_64" in cpu_model()


def test_retune_skips_a_candidate_that_cannot_win(monkeypatch):
    """512 needs a retune (r_N = 2), but if even free generation keeps its q below the reference's on
    every seed (win cap N*_ref x q_free / q_ref < N*_ref), no LR can make it win: no bracket is run."""
    from rlengine.tune import stage1

    n_ref = 0.45 * 8000
    monkeypatch.setattr(stage1, "win_caps", lambda *a: {("512", s): 0.9 * n_ref for s in (0, 1)})
    log, notes = [], []
    s1 = stage1.run_stage1(spec(b_train=(128, 512), fixed_lr=False), synthetic_runner(log), notes)
    assert not [p for p in log if p.stage == "retune"] and not s1.lr_scales
    assert any("512: r_N > 1 + 0.1, not retuned" in n and "cannot win even at r_N = 1" in n for n in notes)
    monkeypatch.setattr(stage1, "win_caps", lambda *a: {("512", 0): 0.9 * n_ref, ("512", 1): 1.1 * n_ref})
    log = []
    stage1.run_stage1(spec(b_train=(128, 512), fixed_lr=False), synthetic_runner(log), [])
    assert len([p for p in log if p.stage == "retune"]) == 4      # one seed could still win: bracket runs


def test_a_censored_bracket_member_never_beats_one_that_reached(monkeypatch):
    """The win cap (6000) is below x1's own N* (7200): every bracket run stops at 12 x 512 = 6144
    without reaching J*, so its censored mean (6144) is under x1's N*. A lower bound is not a
    smaller N*: x1 (2/2 reached) is kept, not a member that reached on 0/2 seeds."""
    from rlengine.tune import stage1

    monkeypatch.setattr(stage1, "win_caps", lambda *a: {("512", s): 6000.0 for s in (0, 1)})
    log, notes = [], []
    s1 = stage1.run_stage1(spec(b_train=(128, 512), fixed_lr=False), synthetic_runner(log), notes)
    assert [plan_config(JOB, p, "x").train.updates for p in log if p.stage == "retune"] == [12] * 4
    kept = next(c for c in s1.candidates if c.label == "512")
    assert dict(s1.lr_scales)[512] == 1.0 and kept.reached == 2 and kept.hits[0].n_star == pytest.approx(7200)
    assert any("512: r_N > 1 + 0.1; bracket run: the sqrt-rule eta kept" in n for n in notes)



def test_confirmation_order_per_seed_and_sign_test():
    """faster_per_seed by hand: both reached -> compare T; only the baseline missed -> faster when
    the chosen run reached J* before the baseline's run stopped (its T* is beyond that); only the
    chosen missed -> slower when the baseline reached before the chosen run stopped; both missed ->
    unknown. The sign test is the exact binomial tail, doubled."""
    from types import SimpleNamespace

    from rlengine.tune.report_md import confirm_markdown
    from rlengine.tune.stats import faster_per_seed, sign_test_p
    from rlengine.tune.stage_records import Confirmation

    t_c, t_d = [1.0, None, 2.0, None, 3.0, 9.0], [2.0, None, None, 3.0, 2.0, None]
    order = faster_per_seed(t_c, t_d, end_c=[1, 5, 2, 6, 3, 9], end_d=[2, 7, 8, 3, 2, 4])
    assert order == [True, None, True, False, False, None]        # seed 6: 9 > the baseline's 4 at its end
    assert sign_test_p(9, 11) == pytest.approx(2 * (55 + 11 + 1) / 2048)
    assert sign_test_p(2, 4) == 1.0 and sign_test_p(0, 3) == pytest.approx(2 / 8)
    conf = Confirmation(chosen="32 gen 128", default="32 (coupled best)", seeds=(3, 4, 5, 6, 7, 8),
                        t_chosen=tuple(t_c), t_default=tuple(t_d), ratio=(0.5, 1.5), ratio_of_means=0.8,
                        faster=tuple(order), sign_p=sign_test_p(2, 4))
    text = confirm_markdown(SimpleNamespace(confirmation=conf, chosen="32 gen 128"))
    assert "faster on 2 of 4 seeds (3, 5); two-sided sign test p = 1.000" in text


@pytest.mark.parametrize("updates,b_train,cands,given,every", [
    (900, 32, (16, 32, 64, 128), 0, 384),     # the long-response job: N_max 28,800 -> 288 -> up to a multiple of 128
    (60, 32, (16, 32, 64, 128), 0, 128),      # N_max 1,920: one evaluation per largest B_train at least
    (100, 128, (64, 128, 256, 512), 0, 512),  # N_max 12,800 exactly 100 x 128, rounded up to 512
    (900, 32, (16, 32, 64, 128), 256, 256),   # --eval-every wins
])
def test_default_eval_grid_is_about_a_hundred_evaluations(updates, b_train, cands, given, every):
    from rlengine.tune.stage1 import budgets

    spec = TuneSpec(job={"train": {"updates": updates, "b_train": b_train}}, target_j=0.6, b_train=cands,
                    eval_every=given)
    assert budgets(spec) == (updates * b_train, every)
