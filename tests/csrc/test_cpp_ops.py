"""C++ CPU ops (csrc/) against their plain-torch references."""

import pytest
import torch

from rlengine.model import ext as _ext  # noqa: F401  (loads torch.ops.rlengine; fails loudly if the build is missing)
from rlengine.model.layers import rms_norm_ref

from tests.support.kv_cache_ref import store_kvcache_ref
from tests.support.tolerances import tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 3, 97), (33, 512)], ids=["row", "odd-3d", "wide"])
def test_rms_norm_matches_reference(dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.randn(shape[-1], dtype=dtype)
    got = torch.ops.rlengine.rms_norm(x, w, 1e-6)
    ref = rms_norm_ref(x, w, 1e-6)
    torch.testing.assert_close(got, ref, **tol(dtype))


def test_rms_norm_rejects_bad_weight():
    with pytest.raises(RuntimeError, match="w must be"):
        torch.ops.rlengine.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kvcache_writes_slots_and_skips_padding(dtype):
    num_blocks, P, Hkv, D, T = 6, 4, 2, 8, 9
    k_cache = torch.randn(num_blocks, P, Hkv, D, dtype=dtype)
    v_cache = torch.randn(num_blocks, P, Hkv, D, dtype=dtype)
    k, v = torch.randn(T, Hkv, D, dtype=dtype), torch.randn(T, Hkv, D, dtype=dtype)
    slots = torch.randperm(num_blocks * P)[:T]
    slots[3] = -1
    ref_k, ref_v = store_kvcache_ref(k, v, k_cache, v_cache, slots)
    torch.ops.rlengine.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_store_kvcache_rejects_out_of_range_slot():
    k_cache = torch.randn(2, 4, 1, 8)
    v_cache = torch.randn(2, 4, 1, 8)
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.rlengine.store_kvcache(torch.randn(1, 1, 8), torch.randn(1, 1, 8), k_cache, v_cache,
                                         torch.tensor([8]))
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype):
    x = torch.randn(5, 3, 2 * 37, dtype=dtype)
    gate, up = x.split(37, dim=-1)
    torch.testing.assert_close(torch.ops.rlengine.silu_and_mul(x), torch.nn.functional.silu(gate) * up, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_updates_residual_in_place(dtype):
    x, residual, w = torch.randn(7, 96, dtype=dtype), torch.randn(7, 96, dtype=dtype), torch.randn(96, dtype=dtype)
    want_residual = residual + x
    want = rms_norm_ref(want_residual, w, 1e-6)
    got = torch.ops.rlengine.fused_add_rms_norm(x, residual, w, 1e-6)
    torch.testing.assert_close(residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(got, want, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (6, 1, 10), (2, 2, 128)], ids=["gqa2", "mqa-odd-half", "d128"])
def test_qk_norm_rope_matches_model_math(dtype, H, Hkv, D):
    from rlengine.model.config import preset
    from rlengine.model.layers import RotaryEmbedding, apply_rope

    cfg = preset("tiny").replace(num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D, rope_theta=500.0)
    rope = RotaryEmbedding(cfg)
    rope.build(torch.device("cpu"))
    T = 9
    qkv = torch.randn(T, (H + 2 * Hkv) * D, dtype=dtype)
    qw, kw = torch.randn(D, dtype=dtype), torch.randn(D, dtype=dtype)
    pos = torch.randint(0, cfg.max_position_embeddings, (T,))
    q, k = torch.ops.rlengine.qk_norm_rope(qkv, qw, kw, rope.cos_sin, pos, H, Hkv, 1e-6)
    cos, sin = rope(pos, dtype)
    q_ref = apply_rope(rms_norm_ref(qkv[:, : H * D].view(T, H, D), qw, 1e-6), cos, sin)
    k_ref = apply_rope(rms_norm_ref(qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D), kw, 1e-6), cos, sin)
    torch.testing.assert_close(q, q_ref, **tol(dtype))
    torch.testing.assert_close(k, k_ref, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (6, 1, 10)], ids=["gqa2", "mqa-odd-half"])
def test_qk_rope_without_norm_is_bitwise_the_model_math(dtype, H, Hkv, D):
    """q_w = k_w = None (Qwen2, Llama): RoPE only, rounded as apply_rope rounds; on a llama3 RoPE table."""
    from rlengine.model.config import preset
    from rlengine.model.layers import RotaryEmbedding, apply_rope

    cfg = preset("tiny-llama").replace(num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D)
    rope = RotaryEmbedding(cfg)
    rope.build(torch.device("cpu"))
    T = 9
    qkv = torch.randn(T, (H + 2 * Hkv) * D, dtype=dtype)
    pos = torch.randint(0, cfg.max_position_embeddings, (T,))
    q, k = torch.ops.rlengine.qk_norm_rope(qkv, None, None, rope.cos_sin, pos, H, Hkv, 1e-6)
    cos, sin = rope(pos, dtype)
    # bf16: every product is rounded, as in torch, so the op is bitwise equal. fp32: the compiler may
    # contract x * cos + rot * sin into an FMA (one rounding fewer), so allow a few ulps.
    exact = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q, apply_rope(qkv[:, : H * D].view(T, H, D), cos, sin), **exact)
    torch.testing.assert_close(k, apply_rope(qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D), cos, sin), **exact)
    with pytest.raises(RuntimeError, match="both be given or both be None"):
        torch.ops.rlengine.qk_norm_rope(qkv, torch.ones(D, dtype=dtype), None, rope.cos_sin, pos, H, Hkv, 1e-6)


def test_qk_norm_rope_rejects_position_outside_table():
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        torch.ops.rlengine.qk_norm_rope(torch.randn(1, 3 * 8), torch.ones(8), torch.ones(8), torch.randn(2, 4, 8),
                                        torch.tensor([4]), 1, 1, 1e-6)


def test_everything_runs_without_the_extension():
    """With rlengine._C unimportable: one notice naming the fallback ops, and model + engine still work."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['rlengine._C'] = None\n"
        "import torch\n"
        "from rlengine import LLM, SamplingParams\nfrom rlengine.model import ext as _ext\n"
        "assert not _ext.AVAILABLE and not _ext.has_op('rms_norm')\n"
        "llm = LLM('tiny-moe', max_num_seqs=2)\n"
        "assert llm.attention_backend == 'torch'\n"
        "out = llm.generate([[5, 6, 7], [9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))\n"
        "assert all(len(o.outputs[0].token_ids) == 4 for o in out)\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
    notice = [ln for ln in res.stderr.splitlines() if "C++ extension not built" in ln]
    assert len(notice) == 1 and "rms_norm" in notice[0] and "torch fallbacks" in notice[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("N,K", [(64, 512), (7, 37), (130, 1000), (1, 16)], ids=["even", "tails", "wide-k", "one-row"])
def test_skinny_linear_matches_linear(dtype, B, N, K):
    """Every row count (the kernel's and the at::linear fallback's), K not a multiple of 16, N not of 4."""
    gen = torch.Generator().manual_seed(B * 1000 + N + K)
    x = torch.randn(B, K, generator=gen).to(dtype)
    w = torch.randn(N, K, generator=gen).to(dtype)
    with torch.inference_mode():
        got = torch.ops.rlengine.skinny_linear(x, w)
    ref = (x.double() @ w.double().t()).to(dtype)
    assert got.shape == (B, N) and got.dtype == dtype
    # fp32: reassociation only; bf16: one rounding of an fp32-accumulated sum
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (2e-2 * K ** 0.5, 8e-3)
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


def test_skinny_linear_strided_input_and_autograd_fallback():
    x = torch.randn(3, 80)[:, :40]  # row stride 80
    w = torch.randn(9, 40)
    with torch.inference_mode():
        torch.testing.assert_close(torch.ops.rlengine.skinny_linear(x, w), x @ w.t(), atol=1e-5, rtol=1e-5)
    wg = w.clone().requires_grad_()
    y = torch.ops.rlengine.skinny_linear(x, wg)  # grad mode: at::linear, recorded by autograd as usual
    y.sum().backward()
    torch.testing.assert_close(wg.grad, x.sum(0).expand(9, 40), atol=1e-5, rtol=1e-5)


def test_status_lines_show_a_recorded_build_error(monkeypatch):
    """`rlengine info` material: a failed CUDA build's compiler output is shown, not just 'missing'."""
    monkeypatch.setattr(_ext, "BUILD_STATUS", {"rlengine._C": {"ok": True},
                                               "rlengine._C_cuda": {"ok": False, "error": "kv_cache.cu(7): error: boom"}})
    monkeypatch.setattr(_ext, "CUDA_AVAILABLE", False)
    lines = "\n".join(_ext.status_lines())
    assert "rlengine._C (CPU ops): loaded" in lines and "error: boom" in lines


@pytest.mark.parametrize("require", [False, True], ids=["optional", "RLENGINE_REQUIRE_EXT=1"])
def test_setup_records_compiler_error_and_require_makes_it_fatal(tmp_path, require):
    """setup.py on a tree whose only C++ source does not compile: the install goes on (or stops with
    RLENGINE_REQUIRE_EXT=1), the compiler's message is printed and lands in _build_status.json."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for sub in ("csrc", "rlengine/configs", "kernels"):
        (tmp_path / sub).mkdir(parents=True)
    shutil.copy(root / "setup.py", tmp_path)
    (tmp_path / "rlengine" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "csrc" / "broken.cpp").write_text("int broken( {\n")
    env = {**os.environ, "RLENGINE_PORTABLE": "1", "RLENGINE_REQUIRE_EXT": "1" if require else "0"}
    res = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert "broken.cpp:1" in res.stderr and "error" in res.stderr
    if require:
        assert res.returncode != 0 and "RLENGINE_REQUIRE_EXT=1" in res.stderr
    else:
        assert res.returncode == 0, res.stderr[-2000:]
        status = json.loads((tmp_path / "rlengine" / "_build_status.json").read_text())
        assert status["rlengine._C"]["ok"] is False and "broken.cpp:1" in status["rlengine._C"]["error"]
