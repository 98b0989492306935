"""rlengine.tune against hand-computed values on synthetic run histories, plus one real tiny sweep.

The synthetic runner gives every configuration a known learning curve and clock:
J(N) = 0.1 + N / S(B) (linear, so the interpolated N* is exact: N* = (J* - 0.1) * S(B)),
t_gen = D0 + D1 * B_gen per update, t_train = GAMMA * B_train, grad norm = 2 / sqrt(B_train).
Every number the report holds (N*, T, r_N, q/q_ref, the q plateau, the choice, the re-check,
the confirmation ratio, the grad-norm slope) is then a closed form written out in the test.
"""

import json
import math
import tomllib

import pytest

from rlengine.analysis.accounting import best_q_over_r, first_crossing, time_to_target, value_at, TargetRun
from rlengine.cli import main
from rlengine.model.config import ConfigError
from rlengine.rl.config import TrainConfig, load_job_config
from rlengine.tune import TuneSpec, build_rows, choose_row, read_run, report_runs, tune
from rlengine.tune.curves import curve_from_records
from rlengine.tune.runner import plan_config
from rlengine.tune.stage1 import plan_stage1
from rlengine.tune.stage2 import kv_limit, window_point
from rlengine.tune.stage_records import EngineFacts

JOB = load_job_config("rlengine/configs/grpo.toml").to_dict()   # G = 16, B_train 128, lr 1.5e-3
TARGET = 0.55
D0, D1, GAMMA = 0.2, 0.001, 0.002
SCALE = {64: 8000.0, 128: 8000.0, 256: 9000.0, 512: 16000.0}  # S(B): N* = 0.45 * S(B)
FACTS = EngineFacts(num_kv_blocks=64, block_size=16, max_model_len=16, block_bytes=1024, device="cpu")


def synthetic_runner(log):
    """RunPlan -> RunCurve with the closed-form curves above (async B_gen > B_train: 10% more samples)."""
    def run(plan):
        log.append(plan)
        cfg = plan_config(JOB, plan, "unused").to_dict()
        b, b_gen, every = cfg["train"]["b_train"], cfg["gen"]["b_gen"], cfg["eval"]["every_responses"]
        fixed = cfg["train"]["lr_rule"] == "none" and b != cfg["train"]["b0"]
        scale = SCALE[b] * (2.0 if fixed else 1.0) * (1.1 if b_gen > b else 1.0)
        records = [{"update": 0, "N": 0, "J": 0.1}]
        for u in range(1, cfg["train"]["updates"] + 1):
            n = u * b
            # q rises with B_gen up to 2 B_train, then stays flat: a plateau at B_gen = 2 B_train
            t_gen = (D0 + D1 * b) * (0.5 if b_gen >= 2 * b else 1.0)
            rec = {"update": u, "N": n, "t_gen": t_gen, "t_train": GAMMA * b, "actor_grad_norm": 2 / math.sqrt(b),
                   "policy_lag_mean": 0.5 if b_gen > b else 0.0}
            if n // every > (n - b) // every:
                rec["J"] = 0.1 + n / scale
            records.append(rec)
            if plan.target_j is not None and rec.get("J", 0) >= plan.target_j:
                break
        return curve_from_records(records, cfg, name=plan.name, label=plan.label, stage=plan.stage,
                                  stopped_at_target=plan.target_j is not None, engine=FACTS)
    return run


def spec(**kw):
    base = dict(job=JOB, target_j=TARGET, b_train=(64, 128, 256, 512), seeds=(0, 1), fixed_lr=True, n_max=20480,
                eval_every=512, probe_updates=6, probe_skip=1, confirm_seeds=2)
    return TuneSpec(**{**base, **kw})


def t_star(b, b_gen=None, scale_mult=1.0):
    """Hand-computed T at N*: N*/B updates, each t_gen + t_train."""
    b_gen = b_gen or b
    n_star = (TARGET - 0.1) * SCALE[b] * scale_mult
    per_update = (D0 + D1 * b) * (0.5 if b_gen >= 2 * b else 1.0) + GAMMA * b
    return n_star, n_star / b * per_update


def test_accounting_first_crossing_and_value_at():
    assert first_crossing([0, 10, 20], [0.1, 0.4, 0.8], 0.6) == pytest.approx(15.0)
    assert first_crossing([0, 10], [0.7, 0.9], 0.6) == 0.0
    assert first_crossing([0, 10], [0.1, 0.5], 0.6) is None
    # a dip after the crossing does not move N*: the FIRST crossing counts
    assert first_crossing([0, 10, 20, 30], [0.1, 0.7, 0.5, 0.9], 0.6) == pytest.approx(10 * 0.5 / 0.6)
    assert value_at([0, 10, 20], [0.0, 5.0, 7.0], 15) == pytest.approx(6.0)
    with pytest.raises(ValueError, match="outside"):
        value_at([0, 10], [0, 1], 11)
    rows = time_to_target([TargetRun(batch=1, n_star=10, t=10), TargetRun(batch=2, n_star=12, t=8)], "1")
    assert best_q_over_r(rows).run.batch == 2          # q ratio 1.5 / r_N 1.2 = 1.25 > 1
    assert best_q_over_r(rows, eligible=["1"]).run.batch == 1


def test_stage1_plan_is_sample_matched_with_sqrt_rule():
    plans = plan_stage1(spec())
    assert [p.name for p in plans[:5]] == ["s1-b64-s0", "s1-b128-s0", "s1-b256-s0", "s1-b512-s0", "ctl-b512-fixed-s0"]
    for p in plans:
        cfg = plan_config(JOB, p, "x")
        assert cfg.train.updates * cfg.train.b_train >= 20480 > (cfg.train.updates - 1) * cfg.train.b_train
        assert cfg.gen.b_gen == cfg.train.b_train and cfg.eval.every_responses == 512
        want = 1.5e-3 * (math.sqrt(cfg.train.b_train / 128) if p.stage == "stage1" else 1.0)
        assert cfg.train.lr_effective == pytest.approx(want)


def test_synthetic_tune_matches_hand_computation(tmp_path):
    log = []
    result = tune(spec(), tmp_path, runner=synthetic_runner(log), log=lambda s: None)
    rows = {r.label: r for r in result.rows}
    n128, t128 = t_star(128)
    for b in (64, 256, 512):
        n, t = t_star(b)
        assert rows[f"{b}"].n_star == pytest.approx(n)
        assert rows[f"{b}"].t == pytest.approx(t)
        assert rows[f"{b}"].r_n == pytest.approx(n / n128)
        assert rows[f"{b}"].q_ratio == pytest.approx((n / t) / (n128 / t128))
        assert rows[f"{b}"].t_norm == pytest.approx(t / t128)
        assert rows[f"{b}"].k_star == pytest.approx(n / b)
    n_fixed, _ = t_star(512, scale_mult=2.0)
    assert rows["512 fixed"].r_n == pytest.approx(n_fixed / n128) and not rows["512 fixed"].eligible
    # stage 2: q doubles generation speed at B_gen = 2 B_train and stays flat after: no two points fall
    # below (1 - delta) q_max, so the ladder runs to its end (8 x B_train); critical 2x
    sweeps = {sw.b_train: sw for sw in result.stage2.sweeps}
    assert all(sw.stop_reason == "ladder end" or sw.stop_reason.startswith("pruned") for sw in sweeps.values())
    probed = [sw for sw in sweeps.values() if sw.stop_reason == "ladder end"]
    assert all([p.b_gen for p in sw.points] == [sw.b_train * m for m in (1, 2, 4, 8)] for sw in probed)
    assert all(len(p.q_reps) == 2 and p.spread == 0 and sw.verdict == "gain" for sw in probed for p in sw.points)
    assert probed and all(sw.critical_b_gen == 2 * sw.b_train for sw in probed)
    # the window q of a probe is the closed form: B / (t_gen + t_train)
    sw = probed[0]
    b = sw.b_train
    assert sw.points[1].q == pytest.approx(b / ((D0 + D1 * b) * 0.5 + GAMMA * b))
    # re-check: the async row needs 10% more samples, and its T uses the halved t_gen
    (rc,) = result.stage2.rechecks
    n_rc, t_rc = t_star(rc.b_train, 2 * rc.b_train, scale_mult=1.1)
    assert rows[rc.label].n_star == pytest.approx(n_rc) and rows[rc.label].t == pytest.approx(t_rc)
    # the choice is the eligible row with the smallest hand-computed T
    by_hand = {f"{b}": t_star(b)[1] for b in (64, 128, 256, 512)} | {rc.label: t_rc}
    assert result.chosen == min(by_hand, key=by_hand.get)
    # confirmation: fresh seeds 2, 3, against the best coupled row (B_gen = B_train); ratio =
    # T(chosen) / T(coupled best) in closed form
    conf = result.confirmation
    coupled = min((f"{b}" for b in (64, 128, 256, 512)), key=by_hand.get)
    assert result.chosen != coupled and conf.default == f"{coupled} (coupled best)"
    assert conf.seeds == (2, 3)
    assert conf.ratio == pytest.approx([by_hand[result.chosen] / by_hand[coupled]] * 2)
    base = [p for p in log if p.stage == "confirm" and p.label == conf.default]
    tuned = [p for p in log if p.stage == "confirm" and p.label != conf.default]
    assert [p.seed for p in base] == [p.seed for p in tuned] == [2, 3]
    # the two runs of a seed differ only in gen.b_gen and gen.max_lag
    a, b_ = (plan_config(JOB, p, "x").to_dict() for p in (base[0], tuned[0]))
    assert {(s, k) for s in a for k in a[s] if a[s][k] != b_[s][k]} == {("gen", "b_gen"), ("gen", "max_lag")}
    # grad norm 2 / sqrt(B): slope exactly -0.5 on every seed
    fits = json.loads((tmp_path / "report.json").read_text())["grad_fits"]
    assert fits["all"]["slope_of_means"] == pytest.approx(-0.5) and fits["all"]["slopes"] == pytest.approx([-0.5] * 2)
    # files: the table, a chosen TOML that loads as a job, figures
    md = (tmp_path / "report.md").read_text()
    assert "| 512 fixed |" in md and "Chosen: **" + result.chosen in md
    chosen = TrainConfig.from_dict(tomllib.loads((tmp_path / "chosen.toml").read_text()))
    assert chosen.train.b_train == rows[result.chosen].b_train
    assert chosen.train.lr_effective == pytest.approx(rows[result.chosen].lr)
    assert (tmp_path / "figures" / "tune_j_vs_n.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "figures" / "tune_q_vs_bgen.png").is_file()


def test_candidate_that_never_reaches_is_reported_and_choice_still_works(tmp_path):
    s = spec(n_max=4096, b_train=(128, 512), fixed_lr=False, confirm_seeds=0)  # 512 reaches at N = 7200 > 4096
    result = tune(s, tmp_path, runner=synthetic_runner([]), log=lambda x: None)
    rows = {r.label: r for r in result.rows}
    assert rows["512"].reached == "0/2" and rows["512"].r_n is None and not rows["512"].eligible
    # its lower bound takes the budget (8 updates x 512) as N* on both seeds: 4096 / (0.45 * 8000)
    assert rows["512"].r_n_lower == pytest.approx(4096 / 3600)
    assert any("512 reached J*" in n for n in result.notes)
    assert result.chosen in ("128", "128 gen 256")


def test_spent_budget_skips_runs_and_still_reports(tmp_path):
    """A runner that returns None (time budget spent) after 5 runs: the rest is named, nothing crashes."""
    inner, calls = synthetic_runner([]), []

    def runner(plan):
        calls.append(plan)
        return inner(plan) if len(calls) <= 5 else None

    result = tune(spec(), tmp_path, runner=runner, log=lambda x: None)
    skipped = [n for n in result.notes if "time budget spent" in n]
    assert len(skipped) == len(calls) - 5 > 0
    assert {r.label: r.reached for r in result.rows}["128"] == "1/1"     # seed 0 ran, seed 1 did not
    assert (tmp_path / "report.md").is_file()


def test_kv_limit_binds_the_ladder(tmp_path):
    b_kv, source, blocks = kv_limit(FACTS, kv_bytes=200 * 1024)   # 200 blocks, 1 per sequence
    assert (b_kv, blocks) == (200, 200) and "--kv-bytes" in source
    log = []
    s = spec(b_train=(128,), seeds=(0,), fixed_lr=False, kv_bytes=200 * 1024, confirm_seeds=0)
    result = tune(s, tmp_path, runner=synthetic_runner(log), log=lambda x: None)
    (sw,) = result.stage2.sweeps
    # ladder 128 -> 256 exceeds B_KV = 200: the largest multiple of G = 16 below it is probed instead
    assert [p.b_gen for p in sw.points] == [128, 192] and sw.stop_reason == "B_KV"
    probes = [p for p in log if p.stage == "probe"]
    assert dict(probes[0].overrides)["gen.num_kv_blocks"] == 200


def test_ratios_are_paired_over_seeds_where_both_reached():
    """A seed that is hard for every batch: unpaired means would mix it into r_N, paired ratios do not."""
    from rlengine.tune.stage_records import CandidateStats, TargetHit

    def cand(label, b, n_by_seed):
        hits = tuple(TargetHit(reached=n is not None, n_star=n, t_star=n and n / 1000, k_star=n and n / b)
                     for n in n_by_seed)
        return CandidateStats(label=label, stage="stage1", b_train=b, b_gen=b, lr=1e-3, lr_rule="sqrt",
                              seeds=(0, 1), hits=hits, n_budget=50000.0, grad_norm=(1.0, 1.0), q_run=(1.0, 1.0))
    ref, big = cand("128", 128, (10000, 30000)), cand("512", 512, (15000, None))   # seed 1 hard for both
    rows = {r.label: r for r in build_rows([ref, big], "128")}
    assert rows["512"].r_n == pytest.approx(1.5)                 # seed 0 only: 15000 / 10000
    assert rows["512"].n_star == 15000                           # its own reaching seeds
    assert rows["512"].r_n_lower == pytest.approx((15000 + 50000) / 40000)
    assert rows["128"].r_n == 1.0 and not rows["512"].eligible and rows["128"].eligible


def test_window_point_is_the_window_ratio():
    cfg = plan_config(JOB, plan_stage1(spec())[1], "x").to_dict()
    recs = [{"update": 0, "N": 0, "J": 0.1}] + [
        {"update": u, "N": 128 * u, "t_gen": 0.1 * u, "t_train": 0.2, "actor_grad_norm": 1.0} for u in range(1, 6)]
    p = window_point(curve_from_records(recs, cfg, name="r"), 128, skip=2, updates=4)
    assert p.q == pytest.approx(2 * 128 / (0.3 + 0.2 + 0.4 + 0.2))   # updates 3 and 4
    assert p.q_gen == pytest.approx(2 * 128 / 0.7)


TINY = ["--warmstart.steps", "5", "--task.num_eval", "8", "--task.num_train", "50", "--train.group_size", "4",
        "--train.prompts_per_step", "2", "--train.updates", "3", "--eval.k", "2"]


def test_real_tiny_sweep_report_resume_and_cli(tmp_path):
    """Real Trainer runs (seconds): the report's structure, resume reusing finished runs, `rlengine report`."""
    job = load_job_config("rlengine/configs/grpo.toml", TINY).to_dict()
    s = TuneSpec(job=job, target_j=0.99, b_train=(8, 16), seeds=(0,), fixed_lr=True, confirm_seeds=0,
                 probe_updates=3, probe_skip=1)
    result = tune(s, tmp_path, log=lambda x: None)
    assert {r.label for r in result.rows} == {"8", "16", "16 fixed"}
    for name in ("report.md", "report.json", "runs.jsonl"):
        assert (tmp_path / name).is_file()
    lines = [json.loads(ln) for ln in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert {ln["name"] for ln in lines} == {"s1-b8-s0", "s1-b16-s0", "ctl-b16-fixed-s0"}
    assert all(ln["records"][0]["update"] == 0 for ln in lines)
    meta = json.loads((tmp_path / "runs" / "s1-b8-s0" / "tune_run.json").read_text())
    assert meta["clock"] == "cpu" and meta["cpu_s"] > 0        # clock auto: a CPU job times CPU seconds
    curve = read_run(tmp_path / "runs" / "s1-b8-s0")
    assert curve.clock == "cpu"
    assert curve.b_train == 8 and curve.update_n[-1] == 24   # N_max = the job's 3 updates x B_train 8
    # a second tune with resume reads every run back and starts none
    from rlengine.tune.runner import TrainerRunner

    runner = TrainerRunner(job, tmp_path, resume=True, log=lambda x: None)
    again = tune(s, tmp_path, runner=runner, log=lambda x: None)
    assert runner.done == 0 and [r.n_star for r in again.rows] == [r.n_star for r in result.rows]
    # without --resume an existing run is an error (exit 2), like any user error
    assert main(["tune", "--config", "rlengine/configs/grpo.toml", "--b-train", "24", "--seeds", "1",
                 "--out", str(tmp_path)]) == 2   # 24 is not a multiple of G = 16
    assert main(["report", str(tmp_path / "runs"), "--target-j", "0.99", "--reference", "16",
                 "--out", str(tmp_path / "rep")]) == 0
    assert "| 16 fixed |" in (tmp_path / "rep" / "report.md").read_text()
    assert main(["report", str(tmp_path / "nowhere"), "--target-j", "0.5"]) == 2


def test_report_runs_groups_seeds_and_builds_rows(tmp_path):
    """`report_runs` on hand-written run directories: two seeds of two configurations."""
    for b, scale in ((128, 8000.0), (256, 9000.0)):
        for seed in (0, 1):
            d = tmp_path / f"b{b}-s{seed}"
            d.mkdir()
            cfg = plan_config(JOB, plan_stage1(spec(b_train=(b,)))[0], d).to_dict()
            cfg["train"].update(b_train=b, prompts_per_step=b // 16)
            cfg["gen"]["b_gen"] = b
            cfg["run"]["seed"] = seed
            (d / "config.json").write_text(json.dumps(cfg))
            recs = [{"update": 0, "N": 0, "J": 0.1}] + [
                {"update": u, "N": u * b, "t_gen": 0.1, "t_train": 0.1, "actor_grad_norm": 1.0,
                 "J": 0.1 + u * b / (scale + 1000 * seed)} for u in range(1, 40)]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rep = report_runs([tmp_path], TARGET, reference="128")
    rows = {r.label: r for r in rep.rows}
    n128 = [(TARGET - 0.1) * (8000 + 1000 * s) for s in (0, 1)]
    n256 = [(TARGET - 0.1) * (9000 + 1000 * s) for s in (0, 1)]
    assert rows["128"].n_star == pytest.approx(sum(n128) / 2)
    assert rows["256"].r_n == pytest.approx(sum(n256) / sum(n128))
    assert rows["256"].r_n_range == pytest.approx((min(a / b for a, b in zip(n256, n128)),
                                                   max(a / b for a, b in zip(n256, n128))))
    # T: 0.2 s per update -> T = N* / B * 0.2; 256 halves the updates per sample: it wins
    assert rows["256"].t == pytest.approx(sum(n / 256 * 0.2 for n in n256) / 2)
    assert rows["256"].wins and rep.chosen == "256"
    assert choose_row(build_rows(rep.candidates, "256"), "256").label == "256"


def test_workers_run_plans_side_by_side_as_in_process(tmp_path):
    """TrainerRunner.map with 2 workers: each plan in its own process gives the run an in-process
    runner gives (same J, N and grad norms: training is deterministic given config and seed);
    a worker that fails names its log; a spent budget starts nothing."""
    from rlengine.tune.runner import TrainerRunner, parse_workers
    from rlengine.plan.specs import PlanChange
    from rlengine.tune.stage_records import RunPlan

    job = load_job_config("rlengine/configs/grpo.toml", TINY).to_dict()
    plans = [RunPlan(name=f"w-s{seed}", stage="stage1", label="8", seed=seed, target_j=None,
                     change=PlanChange(b_train=8, updates=3, eval_every_responses=8))
             for seed in (0, 1)]
    lines = []
    both = TrainerRunner(job, tmp_path / "par", workers=2, log=lines.append).map(plans)
    alone = TrainerRunner(job, tmp_path / "one", log=lambda x: None).map(plans[:1])
    assert both[0].eval_j == alone[0].eval_j and both[0].update_n == alone[0].update_n
    assert both[0].grad_norm == pytest.approx(alone[0].grad_norm, rel=0, abs=0)
    assert both[1].seed == 1 and both[1].grad_norm != both[0].grad_norm     # two runs, not one read twice
    assert len(lines) == 2 and (tmp_path / "par" / "logs" / "w-s1.log").is_file()
    meta = json.loads((tmp_path / "par" / "runs" / "w-s0" / "tune_run.json").read_text())
    assert meta["threads"] == 1 and meta["clock"] == "cpu"
    broken = TrainerRunner(job, tmp_path / "bad", workers=2, log=lambda x: None)
    broken.python = "false"                                   # a worker that exits 1 and writes nothing
    with pytest.raises(RuntimeError, match=r"run w-s0 failed in its worker \(exit 1\); its log .*w-s0.log"):
        broken.map(plans)
    spent = TrainerRunner(job, tmp_path / "late", workers=2, budget_s=1e-9, log=lambda x: None)
    assert spent.map(plans) == [None, None] and not (tmp_path / "late" / "runs").exists()
    assert parse_workers("3", job, 1) == 3 and parse_workers("auto", job, 64) == 1
    with pytest.raises(ConfigError, match="--workers 0"):
        parse_workers("0", job, 1)


def test_a_run_shorter_than_the_jobs_lr_warm_up_ends_its_warm_up_on_its_last_update():
    from rlengine.plan.specs import PlanChange
    from rlengine.tune.stage_records import RunPlan

    job = load_job_config("grpo_long", []).to_dict()   # warmup_updates 20
    assert job["train"]["warmup_updates"] == 20

    def warmup(updates):
        plan = RunPlan(name="p", stage="probe", label="32", seed=0, target_j=None, change=PlanChange(updates=updates))
        return plan_config(job, plan, "x").train.warmup_updates

    assert (warmup(12), warmup(21), warmup(450)) == (11, 20, 20)   # a 12-update probe is a valid config
