"""Qwen2 / Qwen2.5 and Llama 3.x through the shared decoder, against Hugging Face transformers.

Random tiny configs built offline with transformers' own classes (tests/support/hf_models.py ARCH_CONFIGS:
Qwen2 with non-zero q/k/v biases, tied and untied; Llama 3 with the llama3 RoPE rule and a small
original_max_position_embeddings so that every band of the rule changes some frequency, tied and
untied, head_dim from the config or hidden/heads) are saved with save_pretrained and loaded by
rlengine. Checked: logits < 1e-4 in fp32 on the torch path and on the fused no-grad path (C++ ops,
and the Triton kernels under the interpreter); engine greedy decoding token-for-token equal to
transformers' generate() on every CPU attention backend; rlengine's save_pretrained (single file
and sharded) loads back into transformers with identical logits; unsupported features are
ConfigErrors naming the field.
"""

import json

import pytest
import torch

from rlengine import LLM, SamplingParams
from rlengine.model.config import ConfigError, ModelConfig, preset
from rlengine.model import load_pretrained, qwen3, save_pretrained
from rlengine.model.attention import PackedCausal
from rlengine.model.layers import RotaryEmbedding
from rlengine.model.loader import _hf_tensors

from tests.support.hf_models import ARCH_CONFIGS, hf_greedy, make_hf_arch_model, random_prompts, save_hf_model

NAMES = list(ARCH_CONFIGS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, its save_pretrained directory)."""
    out = {}
    for i, name in enumerate(NAMES):
        family, overrides = ARCH_CONFIGS[name]
        hf = make_hf_arch_model(family, overrides, seed=20 + i)
        out[name] = (hf, save_hf_model(hf, tmp_path_factory.mktemp(name) / "ckpt"))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_maps_to_the_same_tensors(checkpoints, name):
    """Every HF tensor is read and written back under its own name: biases for Qwen2, no q/k norms."""
    hf, path = checkpoints[name]
    ours = load_pretrained(path)
    family = ARCH_CONFIGS[name][0]
    assert ours.config.model_type == family and not ours.config.qk_norm
    assert ours.config.architecture == type(hf).__name__
    assert ours.config.attention_bias == (family == "qwen2")
    want = {k: v for k, v in hf.state_dict().items() if not (hf.config.tie_word_embeddings and k == "lm_head.weight")}
    got = _hf_tensors(ours)
    assert set(got) == set(want)
    assert not any("q_norm" in n or "k_norm" in n for n, _ in ours.named_parameters())
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("name", [n for n in NAMES if ARCH_CONFIGS[n][0] == "llama"])
def test_llama3_rope_matches_transformers_and_changes_frequencies(checkpoints, name):
    hf, path = checkpoints[name]
    cfg = load_pretrained(path).config
    assert cfg.rope_type == "llama3"
    ours = RotaryEmbedding(cfg).inv_freq()
    default = RotaryEmbedding(cfg.replace(rope_scaling=None)).inv_freq()
    factor = cfg.rope_scaling["factor"]
    # one frequency kept, at least one slowed by `factor`, at least one blended in between
    kept, slowed = torch.isclose(ours, default), torch.isclose(ours, default / factor)
    assert kept.any() and slowed.any() and (~kept & ~slowed).any(), (ours, default)
    torch.testing.assert_close(ours, hf.model.rotary_emb.inv_freq.float(), atol=0, rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(checkpoints, name):
    hf, path = checkpoints[name]
    ours = load_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    for batch, seqlen in [(1, 1), (3, 45)]:  # 45 > original_max_position_embeddings of the llama3 configs
        ids = torch.randint(0, hf.config.vocab_size, (batch, seqlen), generator=gen)
        with torch.no_grad():
            ref = hf(ids).logits
            for fast in (False, True):
                got = ours(ids, fast=fast)
                err = (got - ref).abs().max().item()
                assert err < 1e-4, f"{name} B={batch} S={seqlen} fast={fast}: max abs logit error {err:.2e}"


@pytest.mark.parametrize("name", [NAMES[0], NAMES[2]])
def test_fast_path_with_triton_kernels_matches_transformers(checkpoints, name):
    """The GPU kernel set (qk_norm_rope without norm weights), run by the interpreter, vs HF logits."""
    hf, path = checkpoints[name]
    ours = load_pretrained(path)
    cu = [0, 4, 11]
    ids = torch.randint(0, hf.config.vocab_size, (cu[-1],), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])
    with torch.no_grad():
        x = ours.model.embed_tokens(ids)
        hidden = ours.model.forward_fused(x, positions, PackedCausal(cu, ours.config.head_dim ** -0.5),
                                          qwen3.triton_ops())
        got = ours.lm_head(hidden)
        ref = torch.cat([hf(ids[a:b][None]).logits[0] for a, b in zip(cu, cu[1:])])
    assert (got - ref).abs().max().item() < 1e-4


# (backend, prompts, longest prompt, new tokens): the interpreter is slow, so triton gets a tiny case
BACKENDS = [("torch", 6, 48, 6), ("cpp", 6, 48, 6), ("triton", 2, 9, 3)]


@pytest.mark.parametrize("backend,num_prompts,max_len,max_new", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("name", NAMES)
def test_engine_greedy_matches_transformers(checkpoints, name, backend, num_prompts, max_len, max_new):
    hf, path = checkpoints[name]
    prompts = random_prompts(num_prompts, hf.config.vocab_size, max_len, seed=len(name))
    llm = LLM(load_pretrained(path), max_num_seqs=max(2, num_prompts // 2), attention_backend=backend,
              block_size=8 if backend != "triton" else 4)
    assert llm.attention_backend == backend
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        toks = out.outputs[0].token_ids
        assert toks == hf_greedy(hf, prompt, max_new), f"{name} prompt of length {len(prompt)}"
        # the returned log-probs are log_softmax of transformers' logits (greedy tokens alone can
        # survive a wrong RoPE on a random tiny model; these cannot)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1:-1]
        ref = logits.log_softmax(-1).gather(1, torch.tensor(toks)[:, None])[:, 0]
        assert (torch.tensor(out.outputs[0].token_logprobs) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_through_transformers(checkpoints, tmp_path, name):
    """rlengine save_pretrained -> transformers from_pretrained -> the original model's logits."""
    from transformers import AutoModelForCausalLM

    hf, path = checkpoints[name]
    ours = load_pretrained(path)
    save_pretrained(ours, tmp_path / "b")
    saved = json.loads((tmp_path / "b" / "config.json").read_text())
    assert saved["model_type"] == ARCH_CONFIGS[name][0] and saved["architectures"] == [type(hf).__name__]
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "b"), dtype=torch.float32).eval()
    assert type(back) is type(hf)
    ids = torch.randint(0, hf.config.vocab_size, (2, 40))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)


@pytest.mark.parametrize("name", [NAMES[1], NAMES[2]])
def test_sharded_checkpoints_in_and_out(checkpoints, tmp_path, name):
    from transformers import AutoModelForCausalLM

    hf, _ = checkpoints[name]
    save_hf_model(hf, tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = load_pretrained(tmp_path / "hf")
    ids = torch.randint(0, hf.config.vocab_size, (2, 9))
    save_pretrained(ours, tmp_path / "ours", max_shard_bytes=16_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").exists()
    with torch.no_grad():
        ref = hf(ids).logits
        assert (ours(ids) - ref).abs().max() < 1e-4
        assert torch.equal(load_pretrained(tmp_path / "ours")(ids), ours(ids))
        back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32).eval()
        assert torch.equal(back(ids).logits, ref)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_presets_build_and_transformers_loads_them(tmp_path, name):
    from transformers import AutoModelForCausalLM

    cfg = preset(name)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2) and not cfg.qk_norm
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    model = qwen3.Qwen3ForCausalLM(cfg, seed=4)
    save_pretrained(model, tmp_path / "p")
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "p"), dtype=torch.float32).eval()
    assert type(back).__name__ == cfg.architecture
    ids = torch.randint(3, cfg.vocab_size, (1, 12))
    with torch.no_grad():
        assert (back(ids).logits - model(ids)).abs().max() < 1e-4


def _hf_dict(name: str, **changes) -> dict:
    d = preset(name).to_hf_dict()
    d.update(changes)
    return d


@pytest.mark.parametrize("d,match", [
    (_hf_dict("tiny-qwen2", use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    (_hf_dict("tiny-qwen2", layer_types=["sliding_attention", "full_attention"]), "layer_types.*sliding_attention"),
    (_hf_dict("tiny-llama", attention_bias=True), "attention_bias=true.*Llama"),
    (_hf_dict("tiny-llama", mlp_bias=True), "mlp_bias=true.*Llama"),
    (_hf_dict("tiny-llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope_type 'yarn' is not supported"),
    (_hf_dict("tiny-llama", rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0}),
     "llama3.*missing low_freq_factor"),
    (_hf_dict("tiny", model_type="mistral", architectures=["MistralForCausalLM"]), "model_type 'mistral'"),
    (_hf_dict("tiny", architectures=["LlamaForCausalLM"]), "architecture 'LlamaForCausalLM' for model_type 'qwen3'"),
    (_hf_dict("tiny-llama", hidden_act="gelu"), "hidden_act 'gelu'"),
], ids=["sliding-window", "sliding-layer-types", "llama-attention-bias", "llama-mlp-bias", "rope-yarn",
        "llama3-incomplete", "unknown-model-type", "arch-mismatch", "hidden-act"])
def test_unsupported_configs_are_config_errors(d, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(d)


def test_model_config_switches_are_validated():
    with pytest.raises(ConfigError, match="model_type must be one of"):
        preset("tiny").replace(model_type="gpt2")
    with pytest.raises(ConfigError, match="attention_bias must be True for model_type 'qwen2'"):
        preset("tiny-qwen2").replace(attention_bias=False)
    with pytest.raises(ConfigError, match="num_experts must be 0 for model_type 'llama'"):
        preset("tiny-moe").replace(model_type="llama")
    with pytest.raises(ConfigError, match="rope_type 'dynamic' is not supported"):
        preset("tiny").replace(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
