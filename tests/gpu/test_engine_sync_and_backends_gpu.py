"""GPU tier of the engine: no host sync in decode steps, pinned buffers, attention backends, the sampler on the
device and overlap scheduling. Deselected without CUDA (tests/conftest.py).

- Decode steps make no host sync but the one output read: they run under
  torch.cuda.set_sync_debug_mode("error"), which raises on any synchronising CUDA call, with the
  mode lifted only inside ModelRunner._read_outputs; eagerly and through real CUDA graphs, with
  greedy, seeded, top-k / top-p and copy-on-write steps in the batch.
- The staging and output buffers are pinned (non_blocking copies are truly asynchronous).
- FlashInfer, when installed, against the torch oracle (the check that must pass before `auto`
  may pick it), eagerly and under CUDA graphs.
- The sampler's race and seeded draws on the device: the n = G / sample_seed property and a
  chi-square test against softmax.
- Overlap scheduling (async_scheduling=True): the same tokens as the synchronous engine, and no
  sync in its decode steps either (the previous step's read is the only wait).
tools/gpu_check.sh runs these with the other gpu-marked tests.
"""

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.model.config import preset
from rlengine.engine.model_runner import ModelRunner
from rlengine.engine.sampler import Sampler, make_sampling_batch
from rlengine.engine.sampling_params import sample_seed
from rlengine.model.qwen3 import Qwen3ForCausalLM

from tests.support.sampler_checks import assert_matches_distribution, random_logits

pytestmark = pytest.mark.gpu

MIXED = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
         SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=16, ignore_eos=True),  # fork: copy-on-write
         SamplingParams(n=2, temperature=0.8, top_k=20, top_p=0.9, logprobs_mode="processed", max_tokens=16,
                        ignore_eos=True)]
PROMPTS = [[5, 6, 7, 8, 9], list(range(3, 40)), [11, 12]]


@pytest.fixture(scope="module")
def model():
    return Qwen3ForCausalLM(preset("tiny"), device="cuda", dtype=torch.bfloat16)


def _decode_without_syncs(llm, monkeypatch) -> int:
    """Admit everything (prefill steps may sync), then run the decode steps under sync-debug 'error'."""
    for prompt, p in zip(PROMPTS, MIXED):
        llm.add_request(prompt, p)
    while llm.scheduler.waiting:
        llm.step()
    orig = ModelRunner._read_outputs

    def read_outputs(runner, *args):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return orig(runner, *args)
        finally:
            torch.cuda.set_sync_debug_mode("error")
    monkeypatch.setattr(ModelRunner, "_read_outputs", read_outputs)
    steps = 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while llm.has_unfinished():
            llm.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return steps


@pytest.mark.parametrize("eager,overlap", [(True, False), (False, False), (False, True)],
                         ids=["eager", "cuda-graphs", "cuda-graphs-overlap"])
def test_decode_steps_do_not_sync(model, monkeypatch, eager, overlap):
    llm = LLM(model, max_num_seqs=8, attention_backend="triton", enforce_eager=eager, async_scheduling=overlap)
    if not eager:
        llm.capture_decode_graphs()
    assert llm.runner.inputs.host.is_pinned() and llm.runner.out_host.is_pinned()
    assert _decode_without_syncs(llm, monkeypatch) >= 10
    if not eager:
        assert llm.runner.graphs.num_replays > 0


def test_flashinfer_matches_the_torch_oracle(model):
    pytest.importorskip("flashinfer")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (int(n),), generator=gen).tolist() for n in (1, 17, 64, 130, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = LLM(model, max_num_seqs=3, attention_backend="torch").generate(prompts, params)
    for eager in (True, False):
        out = LLM(model, max_num_seqs=3, attention_backend="flashinfer", enforce_eager=eager).generate(prompts, params)
        for a, b in zip(out, ref):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"eager={eager}"
            torch.testing.assert_close(torch.tensor(a.outputs[0].token_logprobs), torch.tensor(b.outputs[0].token_logprobs),
                                       atol=5e-2, rtol=0)


def test_seeded_groups_equal_single_requests_on_gpu(model):
    G, seed = 4, 123
    p = dict(temperature=1.0, top_p=0.95, max_tokens=10, ignore_eos=True)
    llm = LLM(model, max_num_seqs=8, attention_backend="triton")
    (group,) = llm.generate([[5, 6, 7, 8, 9, 10, 11]], SamplingParams(n=G, seed=seed, **p))
    singles = llm.generate([[5, 6, 7, 8, 9, 10, 11]] * G, [SamplingParams(seed=sample_seed(seed, i), **p)
                                                           for i in range(G)])
    assert [c.token_ids for c in group.outputs] == [o.outputs[0].token_ids for o in singles]
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1


@pytest.mark.parametrize("seeded", [False, True])
def test_race_matches_softmax_on_gpu(seeded):
    V, n = 1000, 20_000
    logits = random_logits(V, seed=3, scale=2.0)
    params = SamplingParams(temperature=1.0, top_k=50, seed=0 if seeded else None)
    sb = make_sampling_batch([params] * n, device="cuda", seed_keys=list(range(n)) if seeded else None,
                             vocab_size=V)
    tokens, _ = Sampler(torch.device("cuda"))(logits.cuda().expand(n, -1).contiguous(), sb)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[logits.topk(50).indices] = True
    assert_matches_distribution(tokens.cpu(), logits.masked_fill(~keep, float("-inf")).softmax(-1))


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_overlap_matches_the_synchronous_engine_on_gpu(model, eager):
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(n=3, seed=5, top_p=0.9, max_tokens=14, ignore_eos=True),
              SamplingParams(seed=2, temperature=0.8, max_tokens=9, stop_token_ids=[17, 18, 19], ignore_eos=True)]
    outs = [LLM(model, max_num_seqs=8, attention_backend="triton", enforce_eager=eager,
                async_scheduling=overlap).generate(PROMPTS, params) for overlap in (False, True)]
    for a, b in zip(*outs):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
