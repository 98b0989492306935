"""Decode CUDA-graph path (engine/cuda_graph.py) on the CPU, through its StaticReplay stand-in.

StaticReplay replays a bucket's captured forward on the fixed buffers and the capture-time batch
only, as a CUDA graph would, so these tests check the bucketing, the null-block padding and the
buffer filling against transformers and the eager engine. The capture itself needs CUDA:
tests/gpu/test_model_and_engine_gpu.py replays real graphs.
"""

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.engine.attention.torch_backend import TorchBackend
from rlengine.engine.cuda_graph import DecodeGraphs, StaticReplay, bucket_sizes
from rlengine.model import load_pretrained

from tests.support.hf_models import DENSE_CONFIGS, MOE_CONFIGS, hf_greedy, make_hf_model, random_prompts, save_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    hf = make_hf_model("dense", DENSE_CONFIGS["dense_gqa2_untied"], layers=2, seed=5)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("dense") / "ckpt")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    hf = make_hf_model("moe", MOE_CONFIGS["moe_top2_norm"], layers=2, seed=6)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("moe") / "ckpt")


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(64) == [1, 2, 4] + list(range(8, 65, 8))


def _graph_llm(path, backend="cpp", max_num_seqs=5, **kw):
    llm = LLM(load_pretrained(path, moe_impl=kw.pop("moe_impl", "ref")), max_num_seqs=max_num_seqs,
              attention_backend=backend, block_size=kw.pop("block_size", 8), **kw)
    graphs = llm._use_decode_graphs(StaticReplay)
    return llm, graphs


def test_cpu_engine_leaves_graphs_off_and_says_why(dense):
    _, path = dense
    assert "CUDA device" in LLM(load_pretrained(path), attention_backend="cpp").cuda_graphs_off
    assert LLM(load_pretrained(path), enforce_eager=True).cuda_graphs_off == "enforce_eager=True"


def test_graph_replay_matches_transformers_and_eager(dense):
    """16 ragged prompts, B_gen 5: decode steps run in buckets 1, 2, 4, 5 with padding rows."""
    hf, path = dense
    prompts = random_prompts(16, hf.config.vocab_size, 200, seed=21)
    # ragged lengths too, so sequences leave mid-batch and steps run with 1..5 sequences
    params = [SamplingParams(temperature=0.0, max_tokens=3 + i % 8, ignore_eos=True) for i in range(16)]
    llm, graphs = _graph_llm(path)
    outs = llm.generate(prompts, params)
    eager = LLM(load_pretrained(path), max_num_seqs=5, attention_backend="cpp", block_size=8).generate(prompts, params)
    for prompt, p, out, ref in zip(prompts, params, outs, eager):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, p.max_tokens), f"prompt of length {len(prompt)}"
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(out.outputs[0].token_logprobs), torch.tensor(ref.outputs[0].token_logprobs),
                                   atol=1e-5, rtol=0)
    decode_bs = {r.b_act for r in outs.trace if r.kind == "decode"}
    assert graphs.num_replays == sum(r.kind == "decode" for r in outs.trace) > 0
    assert set(graphs.graphs) == {graphs.bucket(b) for b in decode_bs}
    assert decode_bs - set(graphs.sizes), "no decode step ran in a padded bucket"


def test_padding_rows_write_only_the_null_block(dense):
    _, path = dense
    llm, graphs = _graph_llm(path, max_num_seqs=4)
    kv, bm = llm.kv_cache, llm.block_manager
    taken = []
    take = bm._take
    bm._take = lambda: taken.append(take()) or taken[-1]
    sentinel = 7.0
    kv.data.fill_(sentinel)
    kv.data[:, :, kv.null_block].fill_(float("nan"))  # padding rows read only the slot they write
    for prompt in ([9, 9, 1, 2, 3], [4], [7, 7]):  # one decode bucket of 4: a padding row every step
        llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while llm.has_unfinished():
        llm.step()
    assert graphs.graphs.keys() == {4}
    assert graphs.num_replays == 3
    seq_blocks = kv.data[:, :, :bm.num_blocks]
    assert not torch.isnan(seq_blocks).any()
    untouched = sorted(set(range(bm.num_blocks)) - set(taken))
    assert untouched and (kv.data[:, :, untouched] == sentinel).all()
    # the padding rows' K/V went to slot 0 of the null block (finite now); its other slots were not written
    assert torch.isfinite(kv.data[:, :, kv.null_block, 0]).all()
    assert torch.isnan(kv.data[:, :, kv.null_block, 1:]).all()


def test_graphs_survive_kv_exhaustion_and_forks(dense):
    hf, path = dense
    prompts = random_prompts(6, hf.config.vocab_size, 30, seed=4)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    small, graphs = _graph_llm(path, max_num_seqs=6, num_kv_blocks=8)
    outs = small.generate(prompts, params)
    assert outs.stats["preemptions"] > 0 and graphs.num_replays > 0
    full = LLM(load_pretrained(path), max_num_seqs=6, attention_backend="cpp", block_size=8).generate(prompts, params)
    for a, b in zip(outs, full):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_a_backend_reading_host_values_fails_under_replay(dense, monkeypatch):
    """The stand-in is strict: the torch backend plans from context_lens (host), so marking it graph-safe
    must produce wrong tokens. This is the failure a real CUDA graph would give."""
    hf, path = dense
    prompts = random_prompts(4, hf.config.vocab_size, 40, seed=2)
    monkeypatch.setattr(TorchBackend, "graph_safe", True)
    llm, _ = _graph_llm(path, backend="torch", max_num_seqs=4)
    outs = llm.generate(prompts, GREEDY)
    assert any(o.outputs[0].token_ids != hf_greedy(hf, p, 10) for p, o in zip(prompts, outs))


def test_graphs_refuse_unsafe_configurations(dense, moe):
    _, dense_path = dense
    _, moe_path = moe
    llm = LLM(load_pretrained(dense_path), attention_backend="torch")
    with pytest.raises(ValueError, match="torch attention backend is not graph-safe"):
        llm._use_decode_graphs(StaticReplay)
    llm = LLM(load_pretrained(moe_path, moe_impl="ref"), attention_backend="cpp")
    with pytest.raises(ValueError, match="moe_impl='ref'"):
        llm._use_decode_graphs(StaticReplay)
    llm = LLM(load_pretrained(dense_path), attention_backend="cpp", max_num_seqs=4)
    with pytest.raises(ValueError, match=r"sizes must lie in \[1, max_num_seqs=4\]"):
        llm._use_decode_graphs(StaticReplay, sizes=[2, 8])


def test_batches_above_the_largest_bucket_run_eager(dense):
    hf, path = dense
    prompts = random_prompts(6, hf.config.vocab_size, 20, seed=9)
    llm = LLM(load_pretrained(path), max_num_seqs=6, attention_backend="cpp", block_size=8)
    graphs = llm._use_decode_graphs(StaticReplay, sizes=[1, 2])
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 10)
    steps = [r.b_act for r in outs.trace if r.kind == "decode"]
    assert graphs.num_replays == sum(b <= 2 for b in steps) and any(b > 2 for b in steps)


def test_moe_graph_replay_with_routing_record(moe):
    """Triton MoE experts (sync-free, so capturable) under the interpreter; routing ids are graph outputs."""
    hf, path = moe
    prompts = random_prompts(3, hf.config.vocab_size, 12, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm, graphs = _graph_llm(path, max_num_seqs=3, moe_impl="triton", record_routing=True)
    outs = llm.generate(prompts, params)
    eager = LLM(load_pretrained(path, moe_impl="triton"), max_num_seqs=3, attention_backend="cpp", block_size=8,
                record_routing=True).generate(prompts, params)
    assert graphs.num_replays > 0
    for prompt, a, b in zip(prompts, outs, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == hf_greedy(hf, prompt, 3)
        ra, rb = a.outputs[0].routing_ids, b.outputs[0].routing_ids
        assert ra.shape == rb.shape == (len(prompt) + 2, 2, 2)
        assert torch.equal(ra, rb)


def test_triton_backend_graph_replay(dense):
    """The Triton paged-decode kernel under the interpreter, its splits fixed by the bucket's capacity."""
    hf, path = dense
    prompts = random_prompts(3, hf.config.vocab_size, 24, seed=3)
    llm, graphs = _graph_llm(path, backend="triton", max_num_seqs=3, block_size=4, max_model_len=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert graphs.num_replays > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 3)


def test_graphs_see_in_place_weight_updates(dense):
    """Shared weights: an in-place update (what the optimizer does) changes the next replay's tokens."""
    hf, path = dense
    model = load_pretrained(path)
    llm = LLM(model, max_num_seqs=2, attention_backend="cpp", block_size=8)
    graphs = llm._use_decode_graphs(StaticReplay)
    prompt = random_prompts(2, hf.config.vocab_size, 10, seed=5)[1]
    before = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    after = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    eager = LLM(model, max_num_seqs=2, attention_backend="cpp", block_size=8,
                enforce_eager=True).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert graphs.num_replays > 0 and after == eager and after != before


def test_decode_graph_batch_is_static():
    """The bucket batch marks itself static, carries only placeholders in its host fields, and views the
    same buffer addresses that an ordinary decode step padded to the bucket writes (one prepare)."""
    from rlengine.model.config import preset
    from rlengine.model.qwen3 import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(preset("tiny"))
    llm = LLM(model, max_num_seqs=4, attention_backend="cpp", max_model_len=64, block_size=8)
    g = DecodeGraphs(model, llm.backend, llm.runner.inputs, max_bs=4, graph_cls=StaticReplay)
    fb = llm.runner.inputs.static_batch(4)
    assert fb.static and fb.max_num_pages == 8 and fb.batch_size == 4
    llm.runner.inputs.fill_padding(4)
    assert fb.kv_indptr.tolist() == [0, 1, 2, 3, 4] and fb.kv_last_page_len.tolist() == [1] * 4
    assert fb.kv_indices[:4].tolist() == [llm.kv_cache.null_block] * 4
    # a real decode step of 3 sequences padded to bucket 4 writes exactly where the static batch reads
    for prompt in ([5, 6, 7], [8] * 9, [9]):
        llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    llm.step()  # prefill
    batch = llm.scheduler.schedule()
    prep = llm.runner.inputs.prepare(batch, pad_to=4)
    for name in ("input_ids", "positions", "slot_mapping", "kv_indptr", "kv_last_page_len", "kv_indices"):
        assert getattr(prep.fb, name).data_ptr() == getattr(fb, name).data_ptr(), name
    assert fb.positions.tolist() == [3, 9, 1, 0] and fb.kv_indptr.tolist() == [0, 1, 3, 4, 5]
    assert fb.kv_indices[4].item() == llm.kv_cache.null_block and g.bucket(3) == 4


def test_moe_impl_auto_picks_triton_on_a_gpu_only(moe, monkeypatch):
    """The default moe_impl "auto": the torch loop on a CPU (or without triton), Triton on a CUDA device, so
    MoE decode steps there are graph-safe; a bad name is refused."""
    from rlengine.model import factory

    _, path = moe
    llm = LLM(str(path), attention_backend="cpp")  # the default, on the CPU
    assert {b.impl for b in llm.model.moe_blocks()} == {"ref"}
    monkeypatch.setattr(factory, "triton_available", lambda: True)
    assert factory.resolve_moe_impl("auto", "cuda") == "triton"
    assert factory.resolve_moe_impl("auto", "cpu") == "ref"
    monkeypatch.setattr(factory, "triton_available", lambda: False)
    assert factory.resolve_moe_impl("auto", "cuda:0") == "ref"
    with pytest.raises(ValueError, match="moe_impl must be 'auto'"):
        factory.resolve_moe_impl("fast", "cpu")
