"""The per-device memory plan (analysis/memory_plan.py) on a byte budget, on the CPU.

The plan's parts must add up to the budget and its B_KV must be docs/METHOD.md's formula on the same
numbers. Then the engine built from a plan: a GRPO-shaped job (P prompts x G samples) whose budget
the plan says fits B_gen at full length runs without a single preemption; a budget that fits one
group but not B_gen still completes, recomputing fewer tokens than it generates (the plan says
to expect preemptions there: B_KV < B_gen); a budget too
small for one group fails when the plan is made, with a message that names the numbers. The CLI
prints the plan.
"""

import math

import pytest

from rlengine import LLM, SamplingParams
from rlengine.analysis.memory import training_state_bytes
from rlengine.analysis.memory_plan import GiB, activation_bytes, plan_memory, sampler_bytes
from rlengine.plan.memory import plan_for_config
from rlengine.analysis.roofline import b_kv, kv_bytes_per_seq
from rlengine.model.config import ConfigError, preset
from rlengine.engine.kv_cache import bytes_per_block
from rlengine.model import Qwen3ForCausalLM
from rlengine.rl.config import load_job_config

import torch

S, P, G, PROMPTS = 40, 16, 4, 4            # 40 tokens = 3 blocks of 16; B_gen = 16 sequences
PROMPT_LEN, MAX_TOKENS = 8, S - 8


def _plan(kv_blocks: int, **kw):
    """A plan of the tiny preset (fp32, trained with AdamW) whose pool gets about kv_blocks blocks."""
    cfg = preset("tiny")
    fixed = training_state_bytes(cfg, "float32") + activation_bytes(cfg, PROMPTS * G * S, "float32") + 2**20
    per_block = bytes_per_block(cfg, P, torch.float32)
    device = math.ceil((fixed + kv_blocks * per_block + per_block // 2) / 0.9)
    return plan_memory(cfg, device_bytes=device, dtype="float32", max_model_len=S, micro_batch_tokens=PROMPTS * G * S,
                       block_size=P, reserve=2**20, b_gen=PROMPTS * G, group_size=G, **kw)


def test_parts_add_up_and_b_kv_is_papers_formula():
    plan = _plan(48)
    assert plan.num_kv_blocks == 48 and plan.bytes_per_block == bytes_per_block(preset("tiny"), P, torch.float32)
    used = plan.training_state + plan.activations + plan.reserve + plan.kv_bytes
    assert used <= 0.9 * plan.device_bytes < used + plan.bytes_per_block
    assert plan.m_kv == kv_bytes_per_seq(preset("tiny"), S, 4)
    assert plan.b_kv == b_kv(0.9, plan.device_bytes, plan.training_state, plan.activations + plan.reserve, plan.m_kv)
    # block rounding: the pool holds floor(blocks / pages per sequence) sequences, at most B_KV
    assert plan.num_kv_blocks // -(-S // P) <= plan.b_kv
    assert plan.b_kv >= plan.b_gen and any("fits" in line for line in plan.lines())


def test_learner_and_sampler_take_turns_in_the_runtime():
    """M_runtime = max(activations, sampler workspace) + reserve: training and generation never overlap."""
    cfg = preset("qwen3-30m")
    kw = dict(device_bytes=8 * GiB, dtype="bfloat16", max_model_len=512, micro_batch_tokens=4096, reserve=GiB)
    small, large = (plan_memory(cfg, sampler=n, **kw) for n in (2**20, 4 * GiB))
    assert small.runtime == small.activations + GiB and large.runtime == 4 * GiB + GiB
    assert large.num_kv_blocks < small.num_kv_blocks
    filtered = sampler_bytes(64, cfg.vocab_size, "bfloat16", filtered=True)
    assert filtered == 64 * cfg.vocab_size * (2 + 4 * 11) > sampler_bytes(64, cfg.vocab_size, "bfloat16", filtered=False)
    processed = plan_memory(cfg, logprobs_mode="processed", **kw)
    assert processed.activations > small.activations  # the processed head keeps more per chunk


def test_a_fixed_pool_that_overruns_the_budget_is_refused():
    """The CPU trainer sizes its own pool: the plan checks it fits, naming the parts."""
    cfg = preset("tiny")
    kw = dict(dtype="float32", max_model_len=S, micro_batch_tokens=64, reserve=2**20, num_kv_blocks=40)
    need = plan_memory(cfg, device_bytes=2**40, **kw)
    used = need.training_state + need.runtime + need.kv_bytes
    assert plan_memory(cfg, device_bytes=math.ceil(used / 0.9), **kw).check().fits
    with pytest.raises(ConfigError, match=r"memory plan: the job needs .* per rank .* KV pool .* \(40 blocks\)"):
        plan_memory(cfg, device_bytes=int(used / 0.9) - 4096, **kw).check()


def _grpo_job(plan) -> dict:
    llm = LLM(Qwen3ForCausalLM(preset("tiny")), max_num_seqs=plan.b_gen, block_size=P, max_model_len=S,
              num_kv_blocks=plan.num_kv_blocks, attention_backend="cpp")
    prompts = [[3 + 11 * i + j for j in range(PROMPT_LEN)] for i in range(PROMPTS)]
    outs = llm.generate(prompts, SamplingParams(n=G, temperature=1.0, max_tokens=MAX_TOKENS, seed=0, ignore_eos=True))
    assert all(len(c.token_ids) == MAX_TOKENS for o in outs for c in o.outputs)
    assert llm.block_manager.num_free == llm.block_manager.num_blocks
    return outs.stats


def test_a_budget_that_fits_the_plan_runs_without_preemption():
    plan = _plan(48)
    assert _grpo_job(plan)["preemptions"] == 0


def test_a_budget_for_one_group_completes_without_a_preemption_storm():
    plan = _plan(14)  # one group at full length (12 blocks), not four
    assert plan.b_kv < plan.b_gen and plan.check() is plan
    stats = _grpo_job(plan)
    # preempted sequences are recomputed, but the recompute stays below the work itself (a storm would
    # recompute the same sequences again and again)
    assert stats["preemptions"] > 0 and stats["recomputed_tokens"] < PROMPTS * G * MAX_TOKENS


def test_a_budget_too_small_for_one_group_fails_at_start_naming_the_numbers():
    with pytest.raises(ConfigError, match=r"gets 10 blocks .* one group of G=4 sequences of 40 tokens needs 12"):
        _plan(10).check()


def test_plan_for_a_train_config_and_the_cli(capsys):
    from rlengine.cli import main

    cfg = load_job_config(None, ["--model.name", "qwen3-0.6b", "--model.dtype", "bfloat16", "--train.group_size", "8",
                             "--train.b_train", "256", "--train.micro_batch", "16", "--gen.max_tokens", "1024"])
    plan = plan_for_config(cfg, device_bytes=141 * GiB, max_model_len=1100)
    assert plan.group_size == 8 and plan.b_gen == 256 and plan.training_state == training_state_bytes(
        preset("qwen3-0.6b"), "bfloat16")
    assert main(["info", "--plan", "rlengine/configs/grpo.toml", "--device-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "B_KV = floor((alpha*C_mem - M_weights - M_runtime) / m_KV(S))" in out and "KV pool" in out
    assert "train.micro_batch = 0: micro-batches of" in out and "sampler workspace" in out
    assert "rollout: group_size=16, prompts_per_step=8, b_train=128, b_gen=128" in out  # the resolved specs
    assert "learner: algo=grpo" in out
    assert main(["info", "--plan", "rlengine/configs/grpo.toml", "--device-memory", "0.0001"]) == 2
    assert "one group of G=" in capsys.readouterr().err


def test_fsdp_shards_the_training_state_but_not_the_weights():
    cfg = preset("qwen3-0.6b")
    kw = dict(device_bytes=141 * GiB, dtype="bfloat16", max_model_len=1024, micro_batch_tokens=8192)
    full, sharded = plan_memory(cfg, **kw), plan_memory(cfg, fsdp_shards=4, **kw)
    assert sharded.weights == full.weights
    assert sharded.training_state - sharded.weights == -(-(full.training_state - full.weights) // 4)
    assert sharded.num_kv_blocks > full.num_kv_blocks
