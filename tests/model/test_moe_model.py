"""MoE in the model: the Triton fused path against the reference, in the learner and the engine; routing replay."""

import copy

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.model.config import preset
from rlengine.model import load_pretrained, save_pretrained
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.learner.batching import grpo_batch
from rlengine.rl.config import TrainSection
from rlengine.rl.learner.learner import Learner, token_logprobs
from rlengine.rl.rollout_group import RolloutGroup

# small odd shapes: C=40, expert F=24, E=5, top-2; one dense layer in the middle
CFG = preset("tiny-moe").replace(hidden_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                                 moe_intermediate_size=24, num_experts=5, num_experts_per_tok=2,
                                 num_hidden_layers=3, mlp_only_layers=[1], vocab_size=61)


def test_triton_moe_matches_reference_logits_and_grads(tmp_path):
    ref = Qwen3ForCausalLM(CFG, seed=1)
    save_pretrained(ref, tmp_path / "m")
    fused = load_pretrained(tmp_path / "m", moe_impl="triton")
    assert fused.moe_impl == "triton" and all(b.impl == "triton" for b in fused.moe_blocks())
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    out_ref, out_fused = ref(ids), fused(ids)
    torch.testing.assert_close(out_fused, out_ref, atol=1e-4, rtol=1e-4)
    grad = torch.randn_like(out_ref)
    out_ref.backward(grad)
    out_fused.backward(grad)
    for (name, p_ref), p_fused in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(p_fused.grad, p_ref.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_engine_greedy_unchanged_with_triton_moe(tmp_path):
    ref = Qwen3ForCausalLM(CFG, seed=2)
    save_pretrained(ref, tmp_path / "m")
    fused = load_pretrained(tmp_path / "m", moe_impl="triton")
    prompts = [[3, 7, 11, 2, 9], [5], [8, 1, 4, 4, 6, 2, 9, 30]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    a = LLM(ref, max_num_seqs=2, attention_backend="torch").generate(prompts, params)
    b = LLM(fused, max_num_seqs=2, attention_backend="torch").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def _groups(llm, seed):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, CFG.vocab_size, (int(n),), generator=gen).tolist() for n in (4, 9, 6)]
    outs = llm.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=seed, ignore_eos=True))
    return [RolloutGroup(i, o.prompt_token_ids, [c.token_ids for c in o.outputs], [c.token_logprobs for c in o.outputs],
                         [1.0, 0.0], [c.policy_versions for c in o.outputs], [c.finish_reason for c in o.outputs],
                         [c.routing_ids for c in o.outputs]) for i, o in enumerate(outs)]


def test_routing_replay_records_and_replays_engine_routing():
    model = Qwen3ForCausalLM(CFG, seed=3)
    llm = LLM(model, max_num_seqs=4, attention_backend="torch", record_routing=True)
    groups = _groups(llm, seed=4)
    L_moe = len(model.moe_blocks())
    for g in groups:
        for c, r in zip(g.completions, g.routing_ids):
            assert r.shape == (len(g.prompt_ids) + len(c) - 1, L_moe, CFG.num_experts_per_tok)
    batch = grpo_batch(groups, normalize_std=True)
    assert batch.routing_ids is not None and batch.routing_ids.shape[0] == batch.input_ids.shape[0]
    valid = batch.loss_mask > 0
    with torch.no_grad():
        plain, _ = token_logprobs(model, batch, 1.0, fused=False)
        for i, block in enumerate(model.moe_blocks()):
            block.replay_ids = batch.routing_ids[:, i]
        replayed, _ = token_logprobs(model, batch, 1.0, fused=False)
        disagreement = [float(b.last_disagreement) for b in model.moe_blocks()]
        for block in model.moe_blocks():
            block.replay_ids = None
    err_plain = (plain[valid] - batch.old_logprobs[valid]).abs().max()
    err_replay = (replayed[valid] - batch.old_logprobs[valid]).abs().max()
    assert err_replay <= err_plain + 1e-6 and err_replay < 1e-5
    assert all(0.0 <= d <= 1.0 for d in disagreement)

    # After an update the learner's own routing drifts from the recorded one; replay keeps using the record
    # and the learner reports the disagreement rate.
    learner = Learner(model, TrainSection(prompts_per_step=3, group_size=2, lr=0.05), replay_routing=True)
    learner.step(copy.deepcopy(batch))
    metrics = learner.step(copy.deepcopy(batch))
    assert "routing_disagreement" in metrics and metrics["routing_disagreement"] > 0


def test_bad_moe_impl_is_rejected():
    with pytest.raises(ValueError, match="moe_impl"):
        Qwen3ForCausalLM(CFG, moe_impl="cuda-magic")
