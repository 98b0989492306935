"""The plan stage: the job's config stays what the user wrote, what was resolved lives in the plan's
specs (and RUN_DIR/plan.json), nothing below the plan reads the values it resolves, and a run
directory written before the plan stage existed still resumes to the same updates."""

import copy
import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from rlengine.plan.specs import LearnerSpec, resolve_learner, resolve_rollout
from rlengine.rl.config import TrainConfig, load_job_config
from rlengine.rl.trainer import Trainer
from rlengine.rl.trainer.run_dir import resume_config

from tests.support.short_runs import short_run_config, without_timings

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"


def test_every_section_and_the_config_are_frozen(tmp_path):
    cfg = short_run_config(tmp_path, "f")
    for section in (cfg, cfg.model, cfg.task, cfg.gen, cfg.train, cfg.warmstart, cfg.eval, cfg.run):
        field = dataclasses.fields(section)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, field, getattr(section, field))


def test_auto_values_stay_as_written_and_resolve_in_the_specs(tmp_path):
    cfg = short_run_config(tmp_path, "a", ["--gen.b_gen", "0", "--train.overlong", "soft",
                                           "--train.agg", "seq-mean-token-sum-norm"])
    assert cfg.gen.b_gen == 0 and cfg.train.micro_batch == 0
    assert cfg.train.overlong_buffer == 0 and cfg.train.loss_norm_len == 0
    rollout, learner = resolve_rollout(cfg), resolve_learner(cfg, micro_batch=0)
    assert rollout.b_gen == rollout.b_train == 16 and rollout.overlong_buffer == 1  # max(1, 4 // 4)
    assert learner.loss_norm_len == cfg.gen.max_tokens == 4 and learner.lr == cfg.train.lr_effective
    assert load_job_config(None, ["--gen.b_gen", "0"]).gen.b_gen == 0
    named = load_job_config(None, ["--run.name", "exp"])
    assert named.run.out_dir == "runs/default" and named.run_dir == "runs/exp"


def test_building_and_running_a_job_leaves_its_config_unchanged(tmp_path):
    cfg = short_run_config(tmp_path, "u", ["--train.updates", "1", "--train.micro_batch", "0"])
    before = copy.deepcopy(cfg)
    trainer = Trainer(cfg)
    trainer.run()
    assert cfg == before and cfg.to_dict() == before.to_dict()
    plan = json.loads((tmp_path / "u" / "plan.json").read_text())
    assert plan["rollout"]["b_gen"] == 16 and plan["engine"]["max_num_seqs"] == 16
    assert plan["learner"]["algo"] == "grpo" and plan["learner"]["micro_batch"] == trainer.learner.spec.micro_batch
    assert plan["memory"]["num_kv_blocks"] == plan["engine"]["num_kv_blocks"] == trainer.llm.kv_pool.cache.num_blocks
    saved = json.loads((tmp_path / "u" / "config.json").read_text())
    assert saved == json.loads(json.dumps(cfg.to_dict())) and saved["gen"]["b_gen"] == 0  # config.json: what the user wrote


def test_a_learner_from_train_options_alone_resolves_like_the_plan():
    t = TrainConfig().train
    spec = LearnerSpec.from_options(t)
    assert spec.options is t and spec.micro_batch == t.micro_batch and spec.group_size == t.group_size == 8


_BELOW_THE_PLAN = ("rlengine/rl", "rlengine/engine", "rlengine/model", "kernels")
_RESOLVED_READ = re.compile(r"\bgen\.b_gen\b|\b(?:g|gen)\.b_gen\b|\btrain\.micro_batch\b|\b(?:t|cfg|tc)\.micro_batch\b"
                            r"|\b(?:cfg|tc|config)\.b_gen\b")


def reads_of_resolved_values(root: Path) -> list[str]:
    """file:line of every read of gen.b_gen / train.micro_batch (or the config's resolved b_gen) in code
    below the plan stage, comments and docstring lines aside."""
    hits = []
    for top in _BELOW_THE_PLAN:
        for path in sorted((root / top).rglob("*.py")):
            if "rl/config" in path.as_posix():
                continue  # the config's own definition, validation, docs and loading
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if _RESOLVED_READ.search(code) and not code.strip().startswith(('"', "'")) and '"' not in code:
                    hits.append(f"{path.relative_to(root)}:{i}")
    return hits


def test_nothing_below_the_plan_reads_what_the_plan_resolves(tmp_path):
    assert reads_of_resolved_values(ROOT) == []
    planted = tmp_path / "rlengine" / "rl" / "learner"
    planted.mkdir(parents=True)
    (planted / "learner.py").write_text("mbs = batch.micro_batches(cfg.train.micro_batch)\nn = t.micro_batch\n")
    assert reads_of_resolved_values(tmp_path) == ["rlengine/rl/learner/learner.py:1", "rlengine/rl/learner/learner.py:2"]


def test_a_run_directory_from_before_the_plan_stage_resumes_to_the_same_updates(tmp_path):
    """run_v0: the default job cut to 4 updates (5 warm-start steps, checkpoints every 2, seed 0, torch
    kernels, one thread), written by the code before the config was frozen, kept through update 2;
    run_v0_updates_3_4.json: that run's own updates 3 and 4."""
    run = tmp_path / "run_v0"
    shutil.copytree(FIXTURES / "run_v0", run)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the fixture was made: the same reduction order
    try:
        cfg = resume_config(run, ["--run.progress", "false"])
        assert cfg.gen.b_gen == 128  # written explicitly by the old code, read as written
        history = Trainer(cfg, resume=True).run()
    finally:
        torch.set_num_threads(threads)
    want = [without_timings(r) for r in json.loads((FIXTURES / "run_v0_updates_3_4.json").read_text())]
    got = [without_timings(r) for r in history if r["update"] > 2]
    # Every token, reward and count is the old code's, exactly. The floats computed from log-probs are the
    # old code's up to fp32 rounding: the C++ CPU kernels (norms, attention) may change their reduction
    # order, which moves a log-prob by ~1e-7; a resume that lost state (weights, Adam moments, RNG) changes
    # update 4's samples and rewards, which stay exact.
    assert [{k: v for k, v in r.items() if k not in LOGPROB_FLOATS} for r in got] == \
           [{k: v for k, v in r.items() if k not in LOGPROB_FLOATS} for r in want]
    for g, w in zip(got, want):
        for k in LOGPROB_FLOATS & w.keys():
            assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-6), (g["update"], k)


# metrics computed from the engine's and the learner's log-probs (fp32 rounding of the kernels)
LOGPROB_FLOATS = {"loss", "actor/pg_loss", "actor_grad_norm", "actor/grad_norm", "logprob_diff", "ratio_mean",
                  "ratio_max", "kl_ref", "actor/entropy", "actor/ppo_kl", "actor/kl_loss"}


def test_a_plan_change_is_the_same_as_its_overrides_and_the_lr_rule_has_one_definition():
    from rlengine.plan.specs import PlanChange
    from rlengine.tune.curves import lr_effective

    change = PlanChange(b_train=64, b_gen=256, max_lag=4, lr=1e-3, b0=32, lr_rule="sqrt", updates=7,
                        eval_every_responses=128, num_kv_blocks=300)
    base = load_job_config("rlengine/configs/grpo.toml")
    changed = change.apply(base)
    assert changed == load_job_config("rlengine/configs/grpo.toml", [f"--{k}={v}" for k, v in change.overrides()])
    assert changed.train.b_train == 64 and changed.train.prompts_per_step == 64 // base.train.group_size
    assert base.train.b_train == 128 and PlanChange.from_overrides(change.overrides()) == change
    assert PlanChange().apply(base) == base
    with pytest.raises(ValueError, match="no field for"):
        PlanChange.from_overrides([("train.algo", "ppo")])
    for rule in ("sqrt", "linear", "none"):  # the tuner's eta of a saved config is the config's own
        cfg = PlanChange(lr_rule=rule).apply(changed)
        assert lr_effective(cfg.to_dict()["train"]) == cfg.train.lr_effective
    assert changed.train.lr_effective == pytest.approx(1e-3 * 2 ** 0.5)


def test_the_tuner_describes_candidates_as_plan_changes():
    from rlengine.plan.specs import PlanChange
    from rlengine.tune import TuneSpec
    from rlengine.tune.stage1 import plan_stage1

    job = load_job_config("rlengine/configs/grpo.toml").to_dict()
    plans = plan_stage1(TuneSpec(job=job, target_j=0.6, b_train=(64, 256), seeds=(0,)))
    assert all(isinstance(p.change, PlanChange) for p in plans)
    assert [p.change.b_train for p in plans] == [64, 128, 256] and all(p.change.b_gen == p.change.b_train
                                                                       for p in plans)


@pytest.mark.parametrize("extra, want", [([], "ref"),                                   # auto on a CPU: the torch loop
                                         (["--gen.batch_invariant", "true"], "invariant"),
                                         (["--model.moe_impl", "triton"], "triton")])
def test_moe_jobs_default_to_auto_and_the_plan_says_what_it_resolved_to(tmp_path, extra, want):
    from rlengine.rl.distributed import Dist
    from rlengine.rl.trainer.parts import build_model_and_tokenizer

    cfg = short_run_config(tmp_path, "moe", ["--model.name", "tiny-moe", *extra])
    assert cfg.model.moe_impl == ("triton" if "triton" in extra else "auto")
    model, _, resolved = build_model_and_tokenizer(cfg, Dist())
    assert resolved == want and model.moe_impl == ("triton" if want == "triton" else "ref")
