"""The activation estimate (analysis/activations.py) is an upper bound on what the learner really uses.

On random configs of every family (Qwen3 dense and MoE, Qwen2 with biases and tied embeddings,
Llama), in fp32 and bf16, with and without activation checkpointing, in the raw and processed
log-prob modes and in batch-invariant mode, one learner forward + backward over a packed
micro-batch of uneven sequences is measured two ways on the CPU:
- saved-tensor accounting: every tensor autograd saves (saved_tensors_hooks), counted once per
  storage, parameters excluded;
- the heap peak of the forward and backward above the level before it (tests/support/cpu_peak.py),
  parameter gradients allocated beforehand (they are training state, not activations).
The estimate's saved part must lie in [1, 1.5] x the first and its total in [1, 1.5] x the second.
Removing a term (the attention's padding, the fp32 norm inputs, the head's workspace) takes it
below the measurement.
"""

import contextlib

import pytest
import torch

from rlengine.analysis.activations import activation_parts
from rlengine.model.config import ModelConfig
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.learner.batching import TrainBatch
from rlengine.rl.learner.logprobs import processed_token_logprobs, token_logprobs
from tests.support.cpu_peak import PeakHeap

LENS = [40, 70, 90, 56]  # 256 tokens, padded to 4 x 90 = 360 rows for SDPA


def _cfg(family: str, *, moe: bool = False, vocab: int = 512, layers: int = 3) -> ModelConfig:
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, model_type=family,
              attention_bias=family == "qwen2", tie_word_embeddings=family == "qwen2")
    if moe:
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
    return ModelConfig(**kw)


def _micro_batch(vocab: int, lens: list[int], seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    mb = TrainBatch.filler(torch.device("cpu"))
    mb.input_ids, mb.cu_seqlens = torch.randint(0, vocab, (T,), generator=g), cu
    mb.targets = torch.randint(0, vocab, (T,), generator=g)
    return mb


def _measure(cfg: ModelConfig, dtype: torch.dtype, lens: list[int], *, checkpointing: bool, mode: str,
             invariant: bool = False) -> tuple[int, int]:
    """(saved bytes, heap peak) of one forward + backward each; the peak after a warm-up under the same meter."""
    model = Qwen3ForCausalLM(cfg, seed=1).to(dtype)
    model.batch_invariant = invariant
    mb = _micro_batch(cfg.vocab_size, lens)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def forward_backward(hooks=contextlib.nullcontext()):
        with hooks:  # the forward only: the backward's recomputations save tensors of their own
            if mode == "processed":
                logp, ent = processed_token_logprobs(model, mb, 1.0, 20, 0.9, checkpointing)
            else:
                logp, ent = token_logprobs(model, mb, 1.0, False, checkpointing)
        (logp.sum() + 0.1 * ent.sum()).backward()

    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    forward_backward(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
    saved = sum(storages.values())
    storages.clear()  # its entries are on the heap the peak reads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one arena: other threads' heaps would count too
    try:
        with PeakHeap():  # warm-up: the dispatch mode's and the ops' one-time allocations
            forward_backward()
        with PeakHeap() as meter:  # apart from the hooks, whose own bookkeeping is on the heap too
            forward_backward()
    finally:
        torch.set_num_threads(threads)
    return saved, meter.peak


CASES = [(family, moe, dtype, ckpt) for family, moe in (("qwen3", False), ("qwen3", True), ("qwen2", False),
                                                        ("llama", False))
         for dtype in ("float32", "bfloat16") for ckpt in (False, True)]


@pytest.mark.parametrize("family,moe,dtype,checkpointing", CASES)
def test_estimate_bounds_saved_tensors_and_the_peak(family, moe, dtype, checkpointing):
    cfg = _cfg(family, moe=moe)
    saved, peak = _measure(cfg, getattr(torch, dtype), LENS, checkpointing=checkpointing, mode="raw")
    est = activation_parts(cfg, sum(LENS), dtype, padded_tokens=len(LENS) * max(LENS), checkpointing=checkpointing)
    assert saved <= est.saved <= 1.5 * saved, (est.saved / saved, saved)
    assert peak <= est.total <= 1.5 * peak, (est.total / peak, peak)


@pytest.mark.parametrize("family,dtype", [("qwen3", "float32"), ("llama", "bfloat16")])
def test_processed_mode_and_a_larger_vocabulary(family, dtype):
    """The processed head's sort keeps more per chunk; V = 4096 over equal lengths (no padding)."""
    for cfg, lens, mode in ((_cfg(family), LENS, "processed"), (_cfg(family, vocab=4096), [64] * 4, "raw")):
        saved, peak = _measure(cfg, getattr(torch, dtype), lens, checkpointing=False, mode=mode)
        est = activation_parts(cfg, sum(lens), dtype, padded_tokens=len(lens) * max(lens), mode=mode)
        assert saved <= est.saved <= 1.5 * saved, (mode, est.saved / saved)
        assert peak <= est.total <= 1.5 * peak, (mode, est.total / peak)


def test_batch_invariant_head_is_counted_whole():
    """Batch-invariant mode keeps [T, V] logits, their log-softmax and exp: the estimate counts them
    (its layers as the torch path's, so only the bound side is checked for them)."""
    cfg = _cfg("qwen3", vocab=4096, layers=1)
    saved, peak = _measure(cfg, torch.float32, [64] * 4, checkpointing=False, mode="raw", invariant=True)
    est = activation_parts(cfg, 256, "float32", head="materialized")
    assert saved <= est.saved <= 1.5 * saved and peak <= est.total <= 1.5 * peak, (est.saved / saved, est.total / peak)
    assert activation_parts(cfg, 256, "float32").saved < saved  # without the [T, V] blocks it falls short


def test_estimate_arithmetic():
    """Hand-computed at one shape: Qwen3 fp32, C 64, H 4, Hkv 2, D 32, F 160, V 512, one layer."""
    cfg = _cfg("qwen3", layers=1)
    T, P = 256, 360
    # per token: two norms 2 x (4 C + 4 + 2 x 4 C) + qkv 4 x 256 + RoPE outputs 4 x 192 + o_proj input 4 x 128
    #   + q / k norms (4 x 6 rsqrt + 4 x 192) + MLP 4 x 4 x 160; per padded token SDPA 4 x 384 + 4 x 4
    layer = T * (2 * 772 + 1024 + 768 + 512 + 792 + 2560) + P * (1536 + 16)
    once = T * (32 + 2 * 4 * 32 + 772) + T * 512 * 4  # ... and the raw head's saved [T, V] log-softmax block
    est = activation_parts(cfg, T, "float32", padded_tokens=P, kernels=False)
    assert est.saved == layer + once
    # the head: grad_h 4 C T, grad_W in the model's dtype (T fits one chunk), 3.5 [T, V] fp32 blocks;
    # a layer's gradients: half its saved bytes and two residual gradients
    assert est.transient == max(4 * 64 * T + 512 * 64 * 4 + 7 * T * 512 * 2, layer // 2 + 2 * 4 * 64 * T)
    ckpt = activation_parts(cfg, T, "float32", padded_tokens=P, checkpointing=True, kernels=False)
    assert ckpt.saved == once + 4 * 64 * T
    assert activation_parts(cfg, 2 * T, "float32", padded_tokens=2 * P, kernels=False).saved == 2 * est.saved
    # the CPU kernels' Functions: norms keep input and output (2 x 4 C), the q / k norm + RoPE its q, k, v
    # (4 x 256), the MLP 3 x 4 x 160 with the SiLU Function (AVX-512 builds) else 4 x 4 x 160; once: the fp32
    # cos / sin table and positions (2 x 4 x 32 + 8), the final norm
    from rlengine.model import ext
    layer_k = T * (2 * 512 + 1024 + 1024 + 512 + (3 if ext.train_silu() else 4) * 640) + P * (1536 + 16)
    once_k = T * (32 + 2 * 4 * 32 + 8 + 512) + T * 512 * 4
    assert activation_parts(cfg, T, "float32", padded_tokens=P, kernels=True).saved == layer_k + once_k
    with pytest.raises(ValueError, match="head must be one of"):
        activation_parts(cfg, T, "float32", head="dense")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_expressions_are_counted_where_the_kernels_do_not_run(dtype, monkeypatch):
    """Without the CPU kernels' Functions (a build without the extension; CUDA) the layers run the torch
    expressions, which keep more: kernels=False bounds that path as tightly."""
    from rlengine.model import train_ops
    monkeypatch.setattr(train_ops, "AVAILABLE", False)
    cfg = _cfg("qwen3")
    saved, peak = _measure(cfg, getattr(torch, dtype), LENS, checkpointing=False, mode="raw")
    est = activation_parts(cfg, sum(LENS), dtype, padded_tokens=len(LENS) * max(LENS), kernels=False)
    assert saved <= est.saved <= 1.5 * saved, (est.saved / saved, saved)
    assert peak <= est.total <= 1.5 * peak, (est.total / peak, peak)
