"""GPU tier of the batch-invariant mode: the Triton invariant kernels compiled for the device (bf16
included), and the engine against the learner in one process on CUDA.

Deselected without a CUDA device (tests/conftest.py); tools/gpu_check.sh's test step runs it (its
"others" shard takes every tests/gpu file it does not name). The interpreter tier
(tests/kernels/test_batch_invariant_triton.py) runs the same checks in fp32 / fp16 and plants the
tile-config-by-M bug that the equality checks catch. Equality is torch.equal; values are compared to
float64 references at fp32 accumulation plus one rounding to the dtype (2^-8 of |y| for bf16).
"""

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.model.config import preset
from rlengine.kernels.invariant_attention import (invariant_attention_ref, invariant_attention_varlen,
                                                  invariant_paged_decode)
from rlengine.kernels.invariant_logsumexp import invariant_logsumexp
from rlengine.kernels.invariant_matmul import invariant_matmul
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.learner.learner import token_logprobs

from tests.support.engine_learner_logprobs import rollout_batch

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
ROUND = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
BATCHES = (slice(5, 6), slice(0, 7), slice(100, 164), slice(0, 513))  # 1, 7, 64, 513 rows


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N,K", [(37, 100), (3072, 1024), (1024, 3072)])  # odd; Qwen3-0.6B's gate_up, down
def test_matmul_rows_alone_equal_rows_in_any_batch(dtype, N, K):
    x, w, b = _rand(513, K, dtype=dtype, seed=1), _rand(N, K, dtype=dtype, seed=2), _rand(N, dtype=dtype, seed=3)
    full = invariant_matmul(x, w, b)
    for r in BATCHES:
        assert torch.equal(invariant_matmul(x[r], w, b), full[r]), r
    ref = x.double() @ w.double().T + b.double()
    bound = K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T + b.double().abs()) + ROUND[dtype] * ref.abs()
    assert ((full.double() - ref).abs() <= bound * 1.01 + 1e-30).all()


def test_logsumexp_rows_are_batch_invariant():
    z = _rand(513, 151936, dtype=torch.float32, seed=4) * 5  # Qwen3's vocabulary
    lse = invariant_logsumexp(z)
    for r in BATCHES:
        assert torch.equal(invariant_logsumexp(z[r]), lse[r]), r
    ref = z.double().logsumexp(-1)
    assert ((lse.double() - ref).abs() <= 1e-6 * ref.abs() + 1e-4).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("P", [5, 16])
def test_paged_decode_equals_the_packed_causal_pass(dtype, P):
    L, H, Hkv, D = 300, 16, 8, 128  # Qwen3-0.6B's heads
    q, k, v = (_rand(L, n, D, dtype=dtype, seed=s) for n, s in ((H, 5), (Hkv, 6), (Hkv, 7)))
    cu = torch.tensor([0, L])
    packed = invariant_attention_varlen(q, k, v, cu, D ** -0.5)
    ref = invariant_attention_ref(q, k, v, cu, D ** -0.5)
    assert ((packed.double() - ref).abs() <= 1e-5 + 2 * ROUND[dtype] * ref.abs()).all()
    pages = -(-L // P)
    order = torch.randperm(pages + 3, generator=torch.Generator().manual_seed(8))[:pages]
    k_cache, v_cache = _rand(pages + 3, P, Hkv, D, dtype=dtype, seed=9), _rand(pages + 3, P, Hkv, D, dtype=dtype, seed=10)
    j = torch.arange(L)
    k_cache[order[j // P].to(DEVICE), (j % P).to(DEVICE)] = k
    v_cache[order[j // P].to(DEVICE), (j % P).to(DEVICE)] = v
    indptr, indices, last = [0], [], []
    for n in range(1, L + 1):
        used = -(-n // P)
        indices += order[:used].tolist()
        indptr.append(len(indices))
        last.append(n - (used - 1) * P)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    out = torch.full_like(q, float("nan"))
    invariant_paged_decode(q, k_cache, v_cache, i32(indptr), i32(indices), i32(last), D ** -0.5, out)
    assert torch.equal(out, packed)


def _model(dtype):
    model = Qwen3ForCausalLM(preset("tiny"), seed=5, dtype=dtype).to(DEVICE)
    model.batch_invariant = True
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_prompt_alone_and_among_40_others_gets_the_same_tokens_and_logprobs(dtype):
    model = _model(dtype)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, model.config.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 40, (41,), generator=g)]
    params = [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=16, ignore_eos=True) for i in range(41)]
    alone = LLM(model, max_num_seqs=1, batch_invariant=True).generate(prompts[:1], params[:1])[0].outputs[0]
    outs = LLM(model, max_num_seqs=41, batch_invariant=True).generate(prompts, params)
    batched = outs[0].outputs[0]
    assert max(r.b_act for r in outs.trace if r.kind == "decode") > 30
    assert alone.token_ids == batched.token_ids
    assert torch.equal(torch.tensor(alone.token_logprobs), torch.tensor(batched.token_logprobs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_sampled_logprob_equals_the_learners_recomputation(dtype):
    """The learner's training forward (grad on) runs the same Triton kernels through autograd Functions."""
    model = _model(dtype)
    batch = rollout_batch(model).to(DEVICE)
    logp, _ = token_logprobs(model, batch, 1.0, fused=False)
    assert logp.requires_grad
    valid = (batch.loss_mask > 0).to(logp.device)
    old = batch.old_logprobs.to(logp.device)
    assert valid.sum() > 20 and torch.equal(logp.detach()[valid], old[valid])
    logp[valid].sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
