"""StepInputs.prepare() (persistent per-row tables, vectorised) against a plain-Python reference.

The reference rebuilds every step's inputs from the sequences' Python lists, the way the engine did
before the persistent tables: ids / positions / slots token by token, FlashInfer CSR page tables
sequence by sequence, sampling rows from each sample's SamplingParams (make_sampling_batch). The
engine runs a workload that fragments the tables (a tiny KV pool: recompute preemptions, forked
groups with copy-on-write, sequences finishing mid-batch) and every prepare() of the run is checked
against the reference, eager and padded to CUDA-graph buckets; after every step each running
sequence's row must hold its length and last token. Decode steps whose rows and block tables did
not change reuse the previous step's page tables and sampling rows; both paths are checked. Last,
FlashInfer's plan() must be handed the page tables on the host (a stand-in wrapper records them).
"""

import numpy as np
import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.engine.cuda_graph import StaticReplay
from rlengine.engine.sampler import draw_keys, make_sampling_batch
from rlengine.engine.step_inputs import StepInputs


def _reference(batch, P):
    """(input_ids, positions, slot_mapping, kv_indptr, kv_indices, kv_last_page_len) from Python lists."""
    ids, positions, slots, indptr, indices, last = [], [], [], [0], [], []
    for seq in batch.seqs:
        n = len(seq)
        span = range(n) if batch.kind == "prefill" else [n - 1]
        ids += [seq.token_ids[p] for p in span]
        positions += list(span)
        slots += [seq.block_table[p // P] * P + p % P for p in span]
        pages = (n + P - 1) // P
        indices += seq.block_table[:pages]
        indptr.append(len(indices))
        last.append(n - (pages - 1) * P)
    return ids, positions, slots, indptr, indices, last


def _check(prep, batch, inputs: StepInputs, pad_to):
    fb, sb = prep.fb, prep.sb
    P, B = inputs.P, len(batch.seqs)
    ids, positions, slots, indptr, indices, last = _reference(batch, P)
    T = len(ids)
    assert fb.input_ids[:T].tolist() == ids and fb.positions[:T].tolist() == positions
    assert fb.slot_mapping[:T].tolist() == slots
    assert fb.kv_indptr[:B + 1].tolist() == indptr and fb.kv_last_page_len[:B].tolist() == last
    assert fb.kv_indices[:indptr[-1]].tolist() == indices
    assert fb.kv_indptr_host[:B + 1].tolist() == indptr and fb.kv_last_page_len_host[:B].tolist() == last
    assert fb.context_lens[:B].tolist() == [len(s) for s in batch.seqs]
    assert fb.max_num_pages == max(b - a for a, b in zip(indptr, indptr[1:]))
    if pad_to:  # padding rows: token 0 at position 0, one page of one token in the null block
        null, pad = inputs.null_block, pad_to - B
        assert fb.input_ids[B:pad_to].tolist() == [0] * pad and fb.slot_mapping[B:pad_to].tolist() == [null * P] * pad
        assert fb.kv_indptr[B + 1:pad_to + 1].tolist() == list(range(indptr[-1] + 1, indptr[-1] + pad + 1))
        assert fb.kv_indices[indptr[-1]:indptr[-1] + pad].tolist() == [null] * pad
    if batch.kind == "prefill":
        qo = np.cumsum([0] + [len(s) for s in batch.seqs]).tolist()
        assert list(fb.qo_indptr) == qo and fb.logits_indices.tolist() == [q - 1 for q in qo[1:]]
        rows = batch.sample_rows if len(batch.samples) != B else None
        assert (sb.logits_rows is None and rows is None) or sb.logits_rows.tolist() == rows
    src_dst = [] if prep.copies is None else list(zip(*(t.tolist() for t in prep.copies)))
    assert src_dst == batch.copies
    samples = batch.samples
    ref = make_sampling_batch([s.params for s in samples], seed_keys=[s.seed_key for s in samples],
                              positions=[len(s) for s in samples], vocab_size=inputs.vocab_size)
    assert sb.num_samples == len(samples)
    for name in ("temperature", "top_k", "top_p", "kind"):
        assert torch.equal(getattr(sb, name), getattr(ref, name)), name
    seeded = [i for i, s in enumerate(samples) if s.seed_key is not None and not s.params.greedy]
    want = draw_keys(np.array([samples[i].seed_key for i in seeded], dtype=np.uint64),
                     np.array([len(samples[i]) for i in seeded], dtype=np.int64)).view(np.int64).tolist()
    assert sb.seed_keys[seeded].tolist() == want
    assert (sb.kinds_any, sb.kinds_all, sb.max_top_k) == (ref.kinds_any, ref.kinds_all, ref.max_top_k)


PARAMS = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
          SamplingParams(n=3, seed=11, top_k=7, max_tokens=9, ignore_eos=True),
          SamplingParams(n=2, temperature=0.8, top_p=0.9, logprobs_mode="processed", max_tokens=12, ignore_eos=True),
          SamplingParams(seed=5, max_tokens=5, ignore_eos=True),
          SamplingParams(n=4, seed=2, temperature=1.2, max_tokens=11, ignore_eos=True)]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded-to-buckets"])
def test_prepare_matches_the_python_reference_under_preemption(monkeypatch, graphs):
    P = 4
    llm = LLM("tiny", dtype="float32", max_num_seqs=8, block_size=P, num_kv_blocks=14, attention_backend="cpp")
    if graphs:
        llm._use_decode_graphs(StaticReplay, sizes=[2, 4, 8])
    inputs = llm.runner.inputs
    orig = StepInputs.prepare
    checked = {"prefill": 0, "decode": 0, "padded": 0, "reused": 0}

    def prepare(self, batch, pad_to=None, prev_step=None):
        before = self._reuse
        prep = orig(self, batch, pad_to, prev_step)
        _check(prep, batch, self, pad_to)
        checked[batch.kind] += 1
        checked["padded"] += bool(pad_to and pad_to > len(batch.seqs))
        checked["reused"] += before is not None and self._reuse is before  # tables kept from the last step
        return prep
    monkeypatch.setattr(StepInputs, "prepare", prepare)
    prompts = [[3 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate([5, 8, 3, 13, 6, 2, 9])]
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    for prompt, p in zip(prompts, params):
        llm.add_request(prompt, p)
    while llm.has_unfinished():
        llm.step()
        for seq in llm.scheduler.running:
            assert inputs.ctx_len[seq.row] == len(seq) and inputs.last_token[seq.row] == seq.token_ids[-1]
    assert llm.num_preemptions > 0 and checked["prefill"] > len(prompts) - 3 and checked["decode"] > 10
    assert checked["padded"] > 0 or not graphs
    assert 0 < checked["reused"] < checked["decode"], checked  # both the rebuild and the reuse path ran
    assert llm.block_manager.num_free == llm.block_manager.num_blocks


def test_flashinfer_plan_gets_host_page_tables(monkeypatch):
    """FlashInfer's plan() wants indptr / last_page_len on the host (given device tensors it copies them
    back: two syncs per step). A stand-in wrapper (FlashInfer needs CUDA: this is the one part that
    cannot run here) records what plan() receives, eagerly and for a CUDA-graph bucket: the host
    (CPU, pinned on a GPU) staging views with the step's values, and the device kv_indices view."""
    import dataclasses
    import sys
    import types

    from rlengine.engine.attention.flashinfer_backend import FlashInferBackend

    plans = []

    class Wrapper:
        def __init__(self, workspace, layout, use_cuda_graph=False, **buffers):
            self.graph = use_cuda_graph

        def plan(self, indptr, indices, last_page_len, *args, **kwargs):
            plans.append((self.graph, indptr.device.type, indptr.tolist(), last_page_len.tolist(), indices))

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=Wrapper))
    llm = LLM("tiny", dtype="float32", max_num_seqs=4, block_size=4, attention_backend="cpp")
    backend = FlashInferBackend(llm.kv_cache, 4, 16, 4)
    for prompt in ([5, 6, 7, 8, 9], [3] * 2):
        llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    llm.step()  # prefill
    batch = llm.scheduler.schedule()
    inputs = llm.runner.inputs
    backend.plan(inputs.prepare(batch).fb)  # eager: lengths 6 and 3 -> pages 2 and 1
    prepared = inputs.prepare(batch, pad_to=4).fb
    static = inputs.static_batch(4)
    backend.plan(dataclasses.replace(static, kv_indptr_host=prepared.kv_indptr_host,  # as DecodeGraphs.replay
                                     kv_last_page_len_host=prepared.kv_last_page_len_host))
    (g0, dev0, indptr0, last0, idx0), (g1, dev1, indptr1, last1, idx1) = plans
    assert (g0, g1) == (False, True) and dev0 == dev1 == "cpu"
    assert indptr0 == [0, 2, 3] and last0 == [2, 3]
    assert indptr1 == [0, 2, 3, 4, 5] and last1 == [2, 3, 1, 1]  # two padding rows of one token
    assert idx1.data_ptr() == static.kv_indices.data_ptr() and idx0.tolist() == idx1[:3].tolist()
