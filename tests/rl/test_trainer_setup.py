"""How the Trainer sets a run up and resumes it: when the KL reference is taken (after the warm start,
restored on resume), PPO/GRPO group sizes, resume rules (the given directory; overrides that would
change the run's meaning rejected), bf16 resume with the saved fp32 masters, processed log-probs
agreeing between engine and learner end to end, and bad data rows reported before training."""

import json
import shutil

import pytest
import torch

from rlengine.cli import main
from rlengine.model.config import ConfigError
from rlengine.rl.config import load_job_config
from rlengine.rl.trainer.run_dir import resume_config
from rlengine.rl.data.tasks import DatasetError
from rlengine.rl.trainer import Trainer

SMALL = ["--warmstart.steps", "30", "--train.updates", "2", "--train.prompts_per_step", "4",
         "--train.group_size", "4", "--eval.every", "2", "--task.num_eval", "8", "--task.num_train", "50",
         "--run.progress", "false"]


def _cfg(tmp_path, name, extra=(), config="rlengine/configs/grpo.toml"):
    return load_job_config(config, SMALL + ["--run.out_dir", str(tmp_path / name), *extra])


def _weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_kl_reference_is_the_policy_after_the_warm_start(tmp_path):
    """kl_coef > 0: the reference is the policy at update 0, so the first update's k3 KL is ~0."""
    tr = Trainer(_cfg(tmp_path, "kl", ["--train.kl_coef", "0.1"]))
    assert tr.warmstart_losses  # the warm start ran and moved the policy
    for (name, p), q in zip(tr.model.named_parameters(), tr.learner.ref.parameters()):
        assert torch.equal(p, q), name
    first = tr.train_step()
    # coupled mode: the batch was sampled by exactly the reference's weights; only the learner's
    # recomputation differs from it (fp32 rounding), so KL = E[ratio - 1 - log ratio] ~ 0; its fp32
    # evaluation near ratio 1 rounds by up to an ulp of 1, so it may come out a few 1e-9 below zero
    assert -torch.finfo(torch.float32).eps < first["kl_ref"] < 1e-6, first["kl_ref"]


def test_kl_reference_is_restored_on_resume_not_recopied(tmp_path):
    tr = Trainer(_cfg(tmp_path, "klr", ["--train.kl_coef", "0.1", "--run.checkpoint_every", "1"]))
    ref0 = _weights(tr.learner.ref)
    tr.run(stop_after=2)
    assert any(not torch.equal(p, ref0[k]) for k, p in tr.model.state_dict().items())  # policy moved
    resumed = Trainer(resume_config(tmp_path / "klr"), resume_from=tmp_path / "klr")
    for k, v in resumed.learner.ref.state_dict().items():
        assert torch.equal(v, ref0[k]), k


def test_ppo_with_groups_trains_on_every_response_and_counts_them(tmp_path):
    cfg = _cfg(tmp_path, "ppo", ["--train.group_size", "3", "--train.critic_warmup", "0"],
               config="rlengine/configs/ppo.toml")
    tr = Trainer(cfg)
    seen = []
    step = tr.learner.step
    tr.learner.step = lambda batch, **kw: seen.append(batch.num_seqs) or step(batch, **kw)
    history = [r for r in tr.run() if r["update"] > 0]
    assert seen == [4 * 3, 4 * 3]  # P x G sequences enter each update
    assert [r["N"] for r in history] == [12, 24]  # and N counts exactly those


def test_grpo_with_one_response_per_prompt_is_rejected():
    with pytest.raises(ConfigError, match="train.group_size"):
        load_job_config("rlengine/configs/grpo.toml", ["--train.group_size", "1"])


def test_resume_reads_the_given_directory_and_rejects_meaning_changing_overrides(tmp_path, capsys):
    Trainer(_cfg(tmp_path, "orig")).run()
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "orig", moved)  # the saved out_dir no longer exists
    cfg = resume_config(moved, ["--train.updates", "3", "--eval.every", "1", "--run.progress=false"])
    assert cfg.run.out_dir == str(moved) and cfg.train.updates == 3 and cfg.eval.every == 1
    tr = Trainer(cfg, resume_from=moved)
    assert tr.update == 2
    history = tr.run()
    assert history[-1]["update"] == 3 and not (tmp_path / "orig").exists()
    for bad in (["--train.prompts_per_step", "8"], ["--gen.temperature=0.5"], ["--model.dtype", "bfloat16"]):
        with pytest.raises(ConfigError, match=bad[0].split("=")[0][2:]):
            resume_config(moved, bad)
        assert main(["train", "--resume", str(moved), *bad]) == 2
        assert "cannot change on --resume" in capsys.readouterr().err


def test_bf16_resume_continues_with_the_saved_masters(tmp_path):
    """(d) bf16 with fp32 masters: resume restores the masters themselves, not the rounded weights."""
    extra = ["--model.dtype", "bfloat16", "--train.updates", "3", "--run.checkpoint_every", "1"]
    full = Trainer(_cfg(tmp_path, "full", extra))
    full.run()
    part = Trainer(_cfg(tmp_path, "part", extra))
    part.run(stop_after=2)
    masters = [m.clone() for m in part.learner.master_params]
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters)  # masters are off the bf16 grid
    resumed = Trainer(resume_config(tmp_path / "part"), resume_from=tmp_path / "part")
    for m, r, p in zip(masters, resumed.learner.master_params, resumed.model.parameters()):
        assert torch.equal(m, r) and torch.equal(p, r.bfloat16())
    resumed.run()
    for a, b in zip(full.learner.master_params, resumed.learner.master_params):
        assert torch.equal(a, b)


def test_processed_logprobs_agree_between_engine_and_learner_with_top_k(tmp_path):
    """With a top-k filter the behaviour log-probs are the filtered distribution's, recomputed the same
    way by the learner (logprob_diff ~ 0); 'raw' would have the learner and engine agree too, but on
    the wrong distribution, so the importance ratio at update 1 must be ~1 only in processed mode."""
    tr = Trainer(_cfg(tmp_path, "topk", ["--gen.top_k", "3"]))
    assert tr.collector.params.logprobs_mode == "processed"
    rec = tr.train_step()
    assert rec["logprob_diff"] < 1e-5, rec["logprob_diff"]
    with pytest.warns(UserWarning, match="logprobs_mode"):
        Trainer(_cfg(tmp_path, "raw", ["--gen.top_k", "3", "--gen.logprobs_mode", "raw"]))


def test_bad_rows_are_reported_before_training(tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    rows[6]["prompt"] = "9" * 2000  # longer than max_position_embeddings - gen.max_tokens
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match=r"data.jsonl:7.*2000"):
        Trainer(_cfg(tmp_path, "bad", ["--task.name", "jsonl", "--task.path", str(data), "--task.reward", "exact"]))
    assert not (tmp_path / "bad" / "checkpoints").exists()
