"""The real-vocabulary job (rlengine/configs/realvocab.toml) on the CPU: a 151,936-id tokenizer built here,
the job's chat template, 256-token responses and the letter-share reward through the reward pool, two
updates. The model is the job's vocabulary on a small shape (a Qwen3-0.6B-shaped update takes minutes on
2 cores; `rlengine train --config realvocab` runs that shape on a GPU)."""

import dataclasses
import json

import pytest

from rlengine.model import save_pretrained
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.plan.memory import RANK_MEMORY_ENV
from rlengine.rl.config import load_job_config
from rlengine.rl.data.rewards import REWARDS
from rlengine.rl.trainer import Trainer
from tools.make_realvocab_tokenizer import build_tokenizer


@pytest.mark.slow
def test_the_real_vocabulary_job_runs_two_updates_with_long_responses(tmp_path, monkeypatch):
    # the plan's share of this host for the rank: a fixed 8 GiB, not what a busy machine has free right now
    monkeypatch.setenv(RANK_MEMORY_ENV, str(8 * 2**30))
    tok = build_tokenizer(tmp_path / "tok")
    cfg = dataclasses.replace(preset("tiny"), vocab_size=151936)
    save_pretrained(Qwen3ForCausalLM(cfg, seed=0), tmp_path / "ckpt")
    job = load_job_config("realvocab", [
        "--model.name", str(tmp_path / "ckpt"), "--model.tokenizer", str(tok), "--model.dtype", "float32",
        "--train.updates", "2", "--train.prompts_per_step", "2", "--train.group_size", "2", "--task.num_eval", "2",
        "--eval.every", "2", "--run.progress", "false", "--run.out_dir", str(tmp_path / "run")])
    assert job.gen.max_tokens == 256 and job.task.chat_template and job.task.reward_workers == 2
    trainer = Trainer(job)
    assert trainer.tok.vocab_size == 151936 and trainer.tok.eos_token_id == 151645
    history = trainer.run()
    steps = [r for r in history if r["update"] > 0]
    assert [r["update"] for r in steps] == [1, 2] and all(r["reward_errors"] == 0 for r in steps)
    assert any(r["reward_std"] > 0 for r in steps)  # groups' rewards differ: the advantages are not zero
    assert max(r["response_length/max"] for r in steps) == 256 and all(r["actor_grad_norm"] > 0 for r in steps)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["engine"]["max_model_len"] > 256 and plan["memory"]["fits"]


def test_letter_share_counts_ascii_letters_among_visible_characters():
    share = REWARDS["letter-share"]
    assert share("ab 12", "") == 0.5 and share("   ", "") == 0.0 and share("Zé!", "") == 1 / 3
