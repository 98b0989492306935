"""Logit parity with Hugging Face transformers (the reference) for Qwen3 and Qwen3-MoE.

Each random tiny config is created and saved with transformers' classes, loaded by
rlengine, and compared on random batches in fp32 (max abs error < 1e-4). The configs vary
GQA ratio (including one KV head), head_dim != hidden/heads, tied embeddings, rope_theta,
norm_topk_prob, top-k 1 and > 1, and sparse-step / mlp_only layouts.
"""

import pytest
import torch

from rlengine.model import load_pretrained, save_pretrained

from tests.support.hf_models import all_configs, make_hf_model, save_hf_model

CASES = all_configs()


@pytest.mark.parametrize("kind,name,overrides", CASES, ids=[c[1] for c in CASES])
def test_logits_match_transformers(tmp_path, kind, name, overrides):
    hf = make_hf_model(kind, overrides, seed=hash(name) % 1000)
    save_hf_model(hf, tmp_path / "ckpt")
    ours = load_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    for batch, seqlen in [(1, 1), (3, 17), (2, 64)]:
        ids = torch.randint(0, hf.config.vocab_size, (batch, seqlen), generator=gen)
        with torch.no_grad():
            ref = hf(ids).logits
            got = ours(ids)
        assert got.shape == ref.shape
        err = (got - ref).abs().max().item()
        assert err < 1e-4, f"{name} B={batch} S={seqlen}: max abs logit error {err:.2e}"


@pytest.mark.parametrize("kind,name,overrides", [CASES[1], CASES[4]], ids=[CASES[1][1], CASES[4][1]])
def test_packed_forward_matches_padded_reference(tmp_path, kind, name, overrides):
    """forward_packed over ragged sequences equals transformers run on each sequence alone."""
    hf = make_hf_model(kind, overrides, seed=3)
    save_hf_model(hf, tmp_path / "ckpt")
    ours = load_pretrained(tmp_path / "ckpt")
    gen = torch.Generator().manual_seed(2)
    lens = [5, 1, 23, 9]
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen) for n in lens]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    with torch.no_grad():
        got = ours.forward_packed(torch.cat(seqs), cu)
        ref = torch.cat([hf(s[None]).logits[0] for s in seqs])
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind,name,overrides", [CASES[0], CASES[1], CASES[3]], ids=[CASES[i][1] for i in (0, 1, 3)])
def test_round_trip_through_transformers(tmp_path, kind, name, overrides):
    """load -> save_pretrained -> transformers loads it -> identical logits."""
    from transformers import AutoModelForCausalLM

    hf = make_hf_model(kind, overrides, seed=5)
    save_hf_model(hf, tmp_path / "a")
    ours = load_pretrained(tmp_path / "a")
    save_pretrained(ours, tmp_path / "b")
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "b"), dtype=torch.float32).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 11))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-4


def test_sharded_checkpoint_loads(tmp_path):
    kind, name, overrides = CASES[3]
    hf = make_hf_model(kind, overrides, seed=7)
    save_hf_model(hf, tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ours = load_pretrained(tmp_path / "sharded")
    ids = torch.randint(0, hf.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-4
    # Our own sharded save loads back identically.
    save_pretrained(ours, tmp_path / "ours", max_shard_bytes=16_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    again = load_pretrained(tmp_path / "ours")
    with torch.no_grad():
        assert torch.equal(again(ids), ours(ids))


def test_bf16_load_runs_close_to_fp32(tmp_path):
    kind, name, overrides = CASES[0]
    hf = make_hf_model(kind, overrides, seed=9)
    save_hf_model(hf, tmp_path / "c")
    ids = torch.randint(0, hf.config.vocab_size, (2, 13))
    with torch.no_grad():
        ref = load_pretrained(tmp_path / "c")(ids)
        for dtype in (torch.bfloat16, torch.float16):
            got = load_pretrained(tmp_path / "c", dtype=dtype)(ids)
            assert got.dtype == dtype
            assert (got.float() - ref).abs().max() < 0.1
