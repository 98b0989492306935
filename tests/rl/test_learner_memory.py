"""The learner's two memory options and how the memory plan counts them: per-layer activation
checkpointing (fewer saved tensors, the same gradients) and the host-streamed KL reference (the
same KL, one decoder layer on the device at a time).

Saved-tensor bytes are counted with torch.autograd.graph.saved_tensors_hooks around the learner's
forward; gradients are compared exactly in fp32 (the recomputation repeats the same ops in the same
order, so the bits agree).
"""

import copy

import torch

from rlengine import LLM
from rlengine.analysis.memory import reference_device_params, training_state_bytes
from rlengine.analysis.activations import activation_parts, layer_saved
from rlengine.analysis.memory_plan import activation_bytes
from rlengine.model import ext
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.config import load_job_config
from rlengine.rl.config import TrainSection
from rlengine.rl.learner.batching import grpo_batch
from rlengine.rl.learner.learner import Learner, token_logprobs
from rlengine.plan.memory import plan_for_config
from tests.rl.test_learner import _rollouts


def _batch(name="tiny", seed=3):
    model = Qwen3ForCausalLM(preset(name), seed=seed)
    groups = _rollouts(LLM(model, max_num_seqs=16, attention_backend="torch"), 3, 3, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    for g in groups:
        g.rewards = torch.rand(3, generator=gen).tolist()
    return model, grpo_batch(groups, normalize_std=True)


def _saved_bytes_and_grads(model, batch, checkpoint_layers):
    m = copy.deepcopy(model)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = token_logprobs(m, batch, temperature=1.0, fused=False, checkpoint_layers=checkpoint_layers)
    ((logp * batch.advantages + 0.1 * ent) * batch.loss_mask).sum().backward()
    return saved[0], [p.grad for p in m.parameters()]


def test_activation_checkpointing_cuts_saved_bytes_and_keeps_the_gradients():
    model, batch = _batch()
    plain, g_plain = _saved_bytes_and_grads(model, batch, False)
    ckpt, g_ckpt = _saved_bytes_and_grads(model, batch, True)
    cfg = model.config
    T, L, C = batch.input_ids.shape[0], cfg.num_hidden_layers, cfg.hidden_size
    inputs = L * T * C * 4  # what each checkpointed layer keeps instead: its fp32 input
    assert ckpt + inputs < 0.5 * plain, (plain, ckpt, inputs)
    for a, b in zip(g_plain, g_ckpt):
        assert torch.equal(a, b)
    # the plan: each layer's saved tensors become its input (s C), plus one layer recomputed at a time
    for kernels in (False, True):  # the torch expressions, the CPU kernels' Functions (model/train_ops.py)
        plain_est, ckpt_est = (activation_parts(cfg, T, "float32", checkpointing=c, kernels=kernels)
                               for c in (False, True))
        silu = kernels and ext.train_silu()
        layers = sum(layer_saved(cfg, i, 4, T, T, kernels=kernels, silu=silu) for i in range(L))
        assert plain_est.saved - ckpt_est.saved == layers - L * T * C * 4
        assert ckpt_est.total < plain_est.total


def test_learner_uses_checkpointing_with_unchanged_gradients():
    model, batch = _batch(seed=5)
    grads = []
    for on in (False, True):
        learner = Learner(copy.deepcopy(model), TrainSection(prompts_per_step=3, group_size=3, kl_coef=0.1,
                                                             activation_checkpointing=on))
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            learner.compute_grads(copy.deepcopy(batch))
        grads.append(([p.grad.clone() for p in learner.model.parameters()], saved[0]))
    (g0, s0), (g1, s1) = grads
    assert s1 < 0.5 * s0
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_streamed_reference_gives_the_same_kl_one_layer_at_a_time():
    model, batch = _batch(seed=7)
    runs = []
    for offload in (False, True):
        learner = Learner(copy.deepcopy(model), TrainSection(prompts_per_step=3, group_size=3, kl_coef=0.2,
                                                             micro_batch=4, ref_offload=offload))
        with torch.no_grad():  # a reference that differs from the policy, so the KL is not 0
            for p in learner.ref.parameters():
                p.mul_(1.05)
        m = learner.compute_grads(copy.deepcopy(batch))
        runs.append((m, [p.grad.clone() for p in learner.model.parameters()], learner))
    (m0, g0, _), (m1, g1, learner) = runs
    assert m0["kl_ref"] > 0 and m1["kl_ref"] == m0["kl_ref"]
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    stream = learner.ref_stream
    L = model.config.num_hidden_layers
    assert stream.fetches == L * 3  # micro_batch 4 of 9 responses: 3 reference forwards of L layers each
    assert stream.peak_resident == 1 and stream.resident == 0
    # between forwards the layers' parameters hold the host copies themselves
    host = {t.data_ptr() for t in stream.host_tensors}
    assert {p.data_ptr() for layer in learner.ref.model.layers for p in layer.parameters()} == host
    assert runs[0][2].ref_stream is None


def test_memory_plan_counts_checkpointing_and_the_streamed_reference():
    cfg = preset("tiny")
    ref = Qwen3ForCausalLM(cfg, seed=0)
    # by the module itself: embedding, LM head (if untied), final norm and the largest decoder layer
    head = {id(p): p.numel() for m in (ref.model.embed_tokens, ref.lm_head, ref.model.norm) for p in m.parameters()}
    want = sum(head.values()) + max(sum(p.numel() for p in layer.parameters()) for layer in ref.model.layers)
    assert reference_device_params(cfg, offload=True) == want
    assert reference_device_params(cfg) == sum(p.numel() for p in ref.parameters())
    full = training_state_bytes(cfg, "float32", kl_reference=True)
    streamed = training_state_bytes(cfg, "float32", kl_reference=True, ref_offload=True)
    assert full - streamed == (reference_device_params(cfg) - want) * 4
    base = ["--train.kl_coef", "0.1", "--gen.num_kv_blocks", "64"]
    plans = {}
    for name, extra in (("plain", []), ("ckpt", ["--train.activation_checkpointing=true"]),
                        ("offload", ["--train.ref_offload=true"])):
        tc = load_job_config("rlengine/configs/grpo.toml", base + extra)
        plans[name] = plan_for_config(tc, device_bytes=64 * 2**30, max_model_len=64, device_type="cpu")
    tokens = plans["plain"].micro_batch * 64  # micro-batch sequences x max_model_len
    assert plans["plain"].activations == activation_bytes(cfg, tokens, "float32")
    assert plans["ckpt"].activations == activation_bytes(cfg, tokens, "float32", checkpointing=True)
    assert plans["ckpt"].activations < plans["plain"].activations
    assert plans["plain"].training_state - plans["offload"].training_state == full - streamed


def test_checkpointing_with_replayed_moe_routing_keeps_the_gradients():
    """The backward re-runs each MoE layer: it must route by the replayed record as the forward did.
    The policy is moved first, so its own routing differs from the recorded one (disagreement > 0)."""
    from tests.model.test_moe_model import CFG, _groups

    model = Qwen3ForCausalLM(CFG, seed=3)
    batch = grpo_batch(_groups(LLM(model, max_num_seqs=4, attention_backend="torch", record_routing=True), seed=4),
                       normalize_std=True)
    Learner(model, TrainSection(prompts_per_step=3, group_size=2, lr=0.05), replay_routing=True).step(
        copy.deepcopy(batch))
    grads = []
    for on in (False, True):
        learner = Learner(copy.deepcopy(model), TrainSection(prompts_per_step=3, group_size=2, micro_batch=2,
                                                             activation_checkpointing=on), replay_routing=True)
        m = learner.compute_grads(copy.deepcopy(batch))
        grads.append(([p.grad.clone() for p in learner.model.parameters()], m["routing_disagreement"]))
    (g0, d0), (g1, d1) = grads
    assert d0 > 0 and d1 == d0
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert all(block.replay_ids is None for block in learner.model.moe_blocks())  # cleared after each backward


def test_streamed_reference_is_saved_and_restored_on_resume(tmp_path):
    from rlengine.rl.trainer import Trainer
    from rlengine.rl.trainer.run_dir import resume_config
    from tests.rl.test_trainer_setup import _cfg

    tr = Trainer(_cfg(tmp_path, "off", ["--train.kl_coef", "0.1", "--train.ref_offload=true",
                                        "--run.checkpoint_every", "1"]))
    ref0 = {k: v.clone() for k, v in tr.learner.ref.state_dict().items()}
    tr.run(stop_after=1)
    resumed = Trainer(resume_config(tmp_path / "off"), resume_from=tmp_path / "off")
    stream = resumed.learner.ref_stream
    assert stream is not None
    host = {t.data_ptr() for t in stream.host_tensors}
    for layer in resumed.learner.ref.model.layers:  # restored into the host copies, still streamed
        assert all(p.data_ptr() in host for p in layer.parameters())
    for k, v in resumed.learner.ref.state_dict().items():
        assert torch.equal(v, ref0[k]), k
    assert resumed.train_step()["kl_ref"] > 0  # the policy moved away from the restored reference
