"""Triton fused elementwise kernels (kernels/fused_norm.py, the GPU twins of csrc/fused_ops.cpp).

Under TRITON_INTERPRET=1 on the CPU, against plain-torch references (Hugging Face Qwen3's
expressions), fp32 and fp16, odd sizes (non-power-of-two C, F, D) and strided inputs.
"""

import pytest
import torch
import torch.nn.functional as F

from rlengine.kernels import fused_norm as fn
from rlengine.model.layers import apply_rope, rms_norm_ref

from tests.support.tolerances import tol

DTYPES = [torch.float32, torch.float16]


def _rope_table(max_pos, D, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, D, 2).float() / D)
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat([freqs, freqs], -1)
    return torch.stack([emb.cos(), emb.sin()]).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 3, 96), (7, 200)])
def test_rms_norm(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    torch.testing.assert_close(fn.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_residual(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 80, generator=g).to(dtype)
    residual = torch.randn(6, 80, generator=g).to(dtype)
    w = torch.randn(80, generator=g).to(dtype)
    want_res = residual + x
    out = fn.fused_add_rms_norm(x, residual, w, 1e-6)
    torch.testing.assert_close(residual, want_res, **tol(dtype))
    torch.testing.assert_close(out, rms_norm_ref(want_res, w, 1e-6), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,F_", [(1, 37), (4, 1536), (3, 1100)])
def test_silu_and_mul(dtype, rows, F_):
    g = torch.Generator().manual_seed(rows + F_)
    big = torch.randn(rows, 2 * F_ + 5, generator=g).to(dtype)
    x = big[:, : 2 * F_]  # row stride 2F + 5: a strided view
    gate, up = x.split(F_, -1)
    torch.testing.assert_close(fn.silu_and_mul(x), F.silu(gate.float()).mul(up.float()).to(dtype), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (6, 1, 24), (2, 2, 128)])
def test_qk_norm_rope(dtype, H, Hkv, D):
    g = torch.Generator().manual_seed(H * 100 + D)
    T, max_pos = 5, 64
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    q_w, k_w = torch.randn(D, generator=g).to(dtype), torch.randn(D, generator=g).to(dtype)
    cs = _rope_table(max_pos, D)
    pos = torch.tensor([0, 3, 63, 17, 17])
    q, k = fn.qk_norm_rope(qkv, q_w, k_w, cs, pos, H, Hkv, 1e-6)
    cos, sin = cs[0, pos].to(dtype).unsqueeze(1), cs[1, pos].to(dtype).unsqueeze(1)
    q_ref = apply_rope(rms_norm_ref(qkv[:, :H * D].view(T, H, D), q_w, 1e-6), cos, sin)
    k_ref = apply_rope(rms_norm_ref(qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D), k_w, 1e-6), cos, sin)
    torch.testing.assert_close(q, q_ref, **tol(dtype))
    torch.testing.assert_close(k, k_ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (6, 1, 24)])
def test_qk_rope_without_norm(dtype, H, Hkv, D):
    """q_w = k_w = None (Qwen2, Llama: NORM=False): RoPE only; with the kv_cache store too."""
    from tests.support.kv_cache_ref import store_kvcache_ref

    g = torch.Generator().manual_seed(H * 10 + D)
    T, max_pos, num_blocks, P = 5, 64, 3, 4
    qkv = (torch.randn(T, (H + 2 * Hkv) * D, generator=g) * 3).to(dtype)  # far from unit RMS: a norm would show
    cs = _rope_table(max_pos, D)
    pos = torch.tensor([0, 3, 63, 17, 17])
    cos, sin = cs[0, pos].to(dtype).unsqueeze(1), cs[1, pos].to(dtype).unsqueeze(1)
    q_ref = apply_rope(qkv[:, :H * D].view(T, H, D), cos, sin)
    k_ref = apply_rope(qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D), cos, sin)
    k_cache = torch.randn(num_blocks, P, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, P, Hkv, D, generator=g).to(dtype)
    slots = torch.tensor([3, 0, -1, 11, 6])
    q, k = fn.qk_norm_rope(qkv, None, None, cs, pos, H, Hkv, 1e-6, kv_cache=(k_cache, v_cache, slots))
    torch.testing.assert_close(q, q_ref, **tol(dtype))
    torch.testing.assert_close(k, k_ref, **tol(dtype))
    ref_k, ref_v = store_kvcache_ref(k, qkv[:, (H + Hkv) * D:].view(T, Hkv, D), k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    with pytest.raises(ValueError, match="both be given or both be None"):
        fn.qk_norm_rope(qkv, torch.ones(D, dtype=dtype), None, cs, pos, H, Hkv, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_stores_kv_cache_in_the_same_launch(dtype):
    """kv_cache=: q and k as without it, and the caches as store_kvcache would leave them (slot -1 skipped)."""
    from tests.support.kv_cache_ref import store_kvcache_ref

    g = torch.Generator().manual_seed(2)
    T, H, Hkv, D, num_blocks, P = 6, 4, 2, 16, 5, 4
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    q_w, k_w = torch.randn(D, generator=g).to(dtype), torch.randn(D, generator=g).to(dtype)
    cs, pos = _rope_table(32, D), torch.tensor([0, 5, 31, 7, 7, 2])
    k_cache = torch.randn(num_blocks, P, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, P, Hkv, D, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * P, generator=g)[:T]
    slots[2] = -1
    want_q, want_k = fn.qk_norm_rope(qkv, q_w, k_w, cs, pos, H, Hkv, 1e-6)
    ref_k, ref_v = store_kvcache_ref(want_k, qkv[:, (H + Hkv) * D:].view(T, Hkv, D), k_cache, v_cache, slots)
    q, k = fn.qk_norm_rope(qkv, q_w, k_w, cs, pos, H, Hkv, 1e-6, kv_cache=(k_cache, v_cache, slots))
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    with pytest.raises(ValueError, match="slot_mapping"):
        fn.qk_norm_rope(qkv, q_w, k_w, cs, pos, H, Hkv, 1e-6, kv_cache=(k_cache, v_cache, slots.int()))


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="w must be"):
        fn.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="last dim must be even"):
        fn.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match=r"qkv must be \[T, \(H \+ 2Hkv\) \* D\]"):
        fn.qk_norm_rope(torch.randn(2, 10), torch.randn(4), torch.randn(4), _rope_table(8, 4), torch.tensor([0, 1]),
                        1, 1, 1e-6)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_model_fast_path_with_triton_kernels_matches_plain_forward(kind):
    """The no-grad fast path with the GPU kernel set (run here by the interpreter) vs the autograd path."""
    from rlengine.model.config import preset
    from rlengine.model import qwen3
    from rlengine.model.attention import PackedCausal

    model = qwen3.Qwen3ForCausalLM(preset("tiny" if kind == "dense" else "tiny-moe"), seed=3)
    with torch.no_grad():  # non-trivial norm weights, so the kernels' weight handling is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    cu = [0, 5, 12, 13]
    ids = torch.randint(3, model.config.vocab_size, (cu[-1],), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])
    want = model.model(ids, positions, PackedCausal(cu, model.config.head_dim ** -0.5))  # grad mode: plain torch
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        got = model.model.forward_fused(x, positions, PackedCausal(cu, model.config.head_dim ** -0.5),
                                        qwen3.triton_ops())
    torch.testing.assert_close(got, want.detach(), atol=1e-4, rtol=1e-4)


def test_engine_greedy_with_triton_fast_path_matches_transformers(monkeypatch, tmp_path):
    """The engine on the GPU kernel set end to end (prefill + paged decode), under the interpreter."""
    from tests.support.hf_models import DENSE_CONFIGS, hf_greedy, make_hf_model, random_prompts, save_hf_model
    from rlengine import LLM, SamplingParams
    from rlengine.model import load_pretrained, qwen3

    hf = make_hf_model("dense", DENSE_CONFIGS["dense_gqa2_untied"], layers=2, seed=4)
    path = save_hf_model(hf, tmp_path / "ckpt")
    monkeypatch.setattr(qwen3, "fused_ops_for", lambda device: qwen3.triton_ops())
    prompts = random_prompts(4, hf.config.vocab_size, 30, seed=6)
    outs = LLM(load_pretrained(path), max_num_seqs=3, attention_backend="cpp", block_size=8).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 5)
