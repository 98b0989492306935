"""The policy-update options as config: bad values rejected with the field's name, Dr. GRPO's length
resolved from gen.max_tokens, `rlengine tune` refusing more than one update per rollout batch, and a
run with epochs x mini-batches counting each response once in N (and one weight version per update)."""

import pytest

from rlengine.cli import main
from rlengine.model.config import ConfigError
from rlengine.rl.config import load_job_config
from rlengine.rl.trainer import Trainer
from rlengine.tune import TuneSpec
from rlengine.tune.report import to_toml
from tests.rl.test_trainer_setup import _cfg

GRPO = "rlengine/configs/grpo.toml"


@pytest.mark.parametrize("override, field", [
    (["--train.ppo_epochs", "0"], "train.ppo_epochs"),
    (["--train.mini_batches", "0"], "train.mini_batches"),
    (["--train.mini_batches", "100000"], "train.mini_batches"),        # more parts than B_train responses
    (["--train.kl_estimator", "k4"], "train.kl_estimator"),
    (["--train.kl_in_reward=true", "--train.kl_reward_coef", "0"], "train.kl_reward_coef"),
    (["--train.kl_reward_coef", "-1"], "train.kl_reward_coef"),
    (["--train.clip_ratio_c", "1.0"], "train.clip_ratio_c"),
    (["--train.agg", "seq-sum"], "train.agg"),
    (["--train.loss_norm_len", "-1"], "train.loss_norm_len"),
    (["--train.adv_whiten", "group"], "train.adv_whiten"),
    (["--train.rollout_is", "tokens"], "train.rollout_is"),
    (["--train.rollout_is_cap", "0.5"], "train.rollout_is_cap"),
    (["--train.ref_offload=true", "--train.parallel", "fsdp"], "train.ref_offload"),
])
def test_bad_update_options_name_their_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_job_config(GRPO, override)


def test_options_that_need_another_setting():
    with pytest.raises(ConfigError, match="train.adv_whiten"):
        load_job_config("rlengine/configs/ppo.toml", ["--train.adv_whiten", "batch"])
    with pytest.raises(ConfigError, match="train.kl_in_reward"):
        load_job_config(GRPO, ["--train.kl_in_reward=true", "--train.credit", "token"])


def test_defaults_and_the_dr_grpo_length():
    t = load_job_config(GRPO).train
    assert (t.ppo_epochs, t.mini_batches, t.kl_estimator, t.kl_in_reward, t.clip_ratio_c, t.adv_whiten,
            t.rollout_is, t.activation_checkpointing, t.ref_offload) == (1, 1, "k3", False, None, "none", "none",
                                                                          False, False)
    cfg = load_job_config(GRPO, ["--train.agg", "seq-mean-token-sum-norm", "--gen.max_tokens", "12"])
    assert cfg.train.loss_norm_len == 0 and cfg.loss_norm_len == 12  # as written; resolved from max_tokens
    cfg = load_job_config(GRPO, ["--train.agg", "seq-mean-token-sum-norm", "--train.loss_norm_len", "40"])
    assert cfg.train.loss_norm_len == cfg.loss_norm_len == 40
    # TOML has no null: an unset clip_ratio_c is left out of a written config and reads back as None
    cfg = load_job_config(GRPO)
    assert "clip_ratio_c" not in to_toml(cfg.to_dict())
    set_c = load_job_config(GRPO, ["--train.clip_ratio_c", "3"])
    assert "clip_ratio_c = 3.0" in to_toml(set_c.to_dict())


@pytest.mark.parametrize("key", ["ppo_epochs", "mini_batches"])
def test_tune_refuses_more_than_one_update_per_batch(key, tmp_path, capsys):
    job = load_job_config(GRPO, [f"--train.{key}", "2"]).to_dict()
    with pytest.raises(ValueError, match=f"train.{key} = 2.*ONE optimizer update per rollout batch"):
        TuneSpec(job=job, target_j=0.5, b_train=(8, 16))
    TuneSpec(job=load_job_config(GRPO).to_dict(), target_j=0.5, b_train=(8, 16))  # the default job is accepted
    toml = tmp_path / "job.toml"
    toml.write_text(to_toml(job))
    assert main(["tune", "--config", str(toml), "--target-j", "0.5", "--out", str(tmp_path / "t")]) == 2
    assert f"train.{key} = 2" in capsys.readouterr().err


def test_epochs_and_mini_batches_count_each_response_once(tmp_path):
    tr = Trainer(_cfg(tmp_path, "em", ["--train.ppo_epochs", "2", "--train.mini_batches", "2"]))
    steps = []
    step = tr.learner.optim.step
    tr.learner.optim.step = lambda: steps.append(1) or step()
    history = [r for r in tr.run() if r["update"] > 0]
    assert [r["N"] for r in history] == [16, 32]  # B_train = 4 x 4 per update, whatever the passes
    assert len(steps) == 2 * 2 * 2  # updates x epochs x mini-batches optimizer steps
    assert tr.llm.weight_version == 2  # the engine's version counts rollout batches trained on


def test_the_readme_option_table_lists_every_train_key():
    import dataclasses
    from pathlib import Path

    from rlengine.rl.config import TrainSection

    text = Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    table = text.split("## RL options and their verl / TRL names", 1)[1].split("\n## ", 1)[0]
    missing = [f.name for f in dataclasses.fields(TrainSection) if f"`train.{f.name}`" not in table]
    assert not missing, f"README option table lacks: {missing}"
