"""GPU tier: the Triton kernels compiled for a real device, and the engine/learner on CUDA.

Deselected automatically without a CUDA device (conftest.py). Run them with
tools/gpu_check.sh, which unsets the Triton interpreter and also runs the GPU benchmarks.
"""

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gqa,ctx", [(1, 1), (4, 300), (8, 2049)])
def test_triton_paged_decode_on_gpu(dtype, gqa, ctx):
    from rlengine.kernels.paged_decode import paged_decode, paged_decode_ref

    B, Hkv, D, P = 5, 2, 128, 16
    pages = -(-ctx // P)
    k_cache = torch.randn(B * pages + 3, P, Hkv, D, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(k_cache.shape[0], device="cuda")[: B * pages].int()
    indptr = torch.arange(0, B * pages + 1, pages, device="cuda", dtype=torch.int32)
    last = torch.full((B,), ctx - (pages - 1) * P, device="cuda", dtype=torch.int32)
    q = torch.randn(B, Hkv * gqa, D, device="cuda", dtype=dtype)
    out = paged_decode(q, k_cache, v_cache, indptr, perm, last, sm_scale=D ** -0.5, max_num_pages=pages)
    ref = paged_decode_ref(q, k_cache, v_cache, indptr, perm, last, sm_scale=D ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_fused_logprob_on_gpu():
    from rlengine.kernels.fused_logprob import fused_logprob, fused_logprob_ref

    T, C, V = 257, 256, 4099
    h = torch.randn(T, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, C, device="cuda", dtype=torch.bfloat16) * 0.05).requires_grad_()
    tgt = torch.randint(0, V, (T,), device="cuda")
    lp, ent = fused_logprob(h, w, tgt, return_entropy=True)
    lp_r, ent_r = fused_logprob_ref(h, w, tgt, return_entropy=True)
    torch.testing.assert_close(lp, lp_r, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(ent, ent_r, atol=5e-2, rtol=5e-2)
    g = torch.randn_like(lp)
    gh, gw = torch.autograd.grad((lp * g).sum() + ent.sum(), (h, w))
    gh_r, gw_r = torch.autograd.grad((lp_r * g).sum() + ent_r.sum(), (h, w))
    torch.testing.assert_close(gh.float(), gh_r.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(gw.float(), gw_r.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_engine_triton_backend_matches_torch_backend_on_gpu(name):
    model = Qwen3ForCausalLM(preset(name), device="cuda", moe_impl="triton" if name == "tiny-moe" else "ref")
    prompts = [torch.randint(3, 200, (n,)).tolist() for n in (1, 17, 64, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    a = LLM(model, max_num_seqs=3, attention_backend="torch").generate(prompts, params)
    b = LLM(model, max_num_seqs=3, attention_backend="triton").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_cuda_graph_decode_matches_eager(name):
    """Real CUDA graphs (captured lazily per bucket) against the same engine run eagerly."""
    moe = name == "tiny-moe"
    model = Qwen3ForCausalLM(preset(name), device="cuda", moe_impl="triton" if moe else "ref")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (int(n),), generator=gen).tolist() for n in (1, 5, 17, 33, 64, 100, 130, 9)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    g = LLM(model, max_num_seqs=5, attention_backend="triton", record_routing=moe)
    e = LLM(model, max_num_seqs=5, attention_backend="triton", record_routing=moe, enforce_eager=True)
    assert g.cuda_graphs_off is None and e.cuda_graphs_off == "enforce_eager=True"
    a, b = g.generate(prompts, params), e.generate(prompts, params)
    assert g.runner.graphs.num_replays == sum(r.kind == "decode" for r in a.trace) > 0
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(x.outputs[0].logprobs), torch.tensor(y.outputs[0].logprobs),
                                   atol=1e-4, rtol=0)
        if moe:
            assert torch.equal(x.outputs[0].routing_ids, y.outputs[0].routing_ids)


def test_cuda_graphs_capture_all_and_see_weight_updates():
    model = Qwen3ForCausalLM(preset("tiny"), device="cuda")
    llm = LLM(model, max_num_seqs=16, attention_backend="triton")
    llm.capture_decode_graphs()
    assert sorted(llm.runner.graphs.graphs) == [1, 2, 4, 8, 16]
    prompts = [[5, 6, 7, 8], [9, 10], [11]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    eager = LLM(model, max_num_seqs=16, attention_backend="triton", enforce_eager=True)
    assert after == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert after != before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fast_path_matches_plain_forward_on_gpu(dtype):
    from rlengine.model import qwen3

    assert qwen3.fused_ops_for(torch.device("cuda")) is qwen3.triton_ops()
    model = Qwen3ForCausalLM(preset("qwen3-30m"), device="cuda", dtype=dtype)
    ids = torch.randint(3, 4000, (2, 40), device="cuda")
    want = model(ids)                    # grad mode: the plain torch path
    with torch.no_grad():
        got = model(ids)                 # no grad on CUDA: the Triton fast path
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want.detach().float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_store_kvcache_matches_index_copy(dtype):
    from conftest import store_kvcache_ref
    from rlengine import _ext

    assert _ext.has_cuda_op("store_kvcache"), "the GPU build should include csrc/cuda/kv_cache.cu"
    num_blocks, P, Hkv, D, T = 9, 16, 4, 128, 37
    k_cache = torch.randn(num_blocks, P, Hkv, D, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    qkv = torch.randn(T, 3, Hkv, D, device="cuda", dtype=dtype)
    k, v = qkv[:, 1], qkv[:, 2]  # strided token rows, as the model passes them
    slots = torch.randperm(num_blocks * P, device="cuda")[:T]
    slots[5] = -1
    ref_k, ref_v = store_kvcache_ref(k, v, k_cache, v_cache, slots)
    torch.ops.rlengine.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
