"""LoRA on the shared decoder (rlengine/model/lora.py) against PEFT on transformers, the reference.

Random tiny Qwen3, Qwen2 (q/k/v biases) and Llama 3 checkpoints are built with transformers' own
classes; PEFT wraps them with random non-zero A and B (PEFT's B starts at zero, which would make any
forward pass trivially equal the base). The same tensors, through rlengine's PEFT mapping
(lora_peft.py), go into rlengine's fused adapters. Checked for each target set (attention only,
fused slices partly targeted, MLP only, all-linear): logits on the learner's torch path, the engine's
fused no-grad path and the batch-invariant path, and the gradients of every adapter tensor, within
fp32 rounding (1e-4 on logits of O(1), as the base parity tests); the adapters actually move the logits;
the block-diagonal zeros of fused B get no gradient. A trained LM head (modules_to_save = ["lm_head"],
PEFT's ModulesToSaveWrapper) matches PEFT's on a tied and an untied base: logits and the head's gradient;
with the adapters off it is the base head, and the tied input embeddings stay the base's. Bad input
(unknown target or module to save, r < 1, MoE experts) is a ConfigError naming the field.
"""

import pytest
import torch

from rlengine.model import load_pretrained
from rlengine.model.config import ConfigError
from rlengine.model.lora import (LoraSpec, add_lora, adapters, adapters_disabled, lora_param_count, lora_parameters,
                                 lora_stored_count)
from rlengine.model.lora_peft import _adapter_slots, _pieces, load_peft_tensors, peft_tensors

from tests.support.hf_models import (ARCH_CONFIGS, DENSE_CONFIGS, MOE_CONFIGS, make_hf_arch_model, make_hf_model,
                                     save_hf_model)

# name -> builder of a random transformers model
MODELS = {
    "qwen3": lambda: make_hf_model("dense", DENSE_CONFIGS["dense_gqa2_untied"], layers=2, seed=5),
    "qwen2_bias": lambda: make_hf_arch_model(*ARCH_CONFIGS["qwen2_gqa_tied"], seed=6),
    "llama3": lambda: make_hf_arch_model(*ARCH_CONFIGS["llama3_hd16_untied"], seed=7),
}
# which path of the fused projections each set covers
TARGET_SETS = {
    "q_v": ["q_proj", "v_proj"],                   # qkv partly targeted (k rows of B all zero)
    "k_o_down": ["k_proj", "o_proj", "down_proj"],  # one slice of qkv, both single projections
    "gate": ["gate_proj"],                         # gate_up partly targeted
    "all": "all-linear",                           # every slice, n = 3 and n = 2 blocks
}
R, ALPHA = 4, 12.0  # scale 3: a wrong scale shows


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: save_hf_model(build(), tmp_path_factory.mktemp(name) / "ckpt") for name, build in MODELS.items()}


def _peft_model(path, targets, seed, saved=None, tie=False):
    """transformers model from `path` wrapped by PEFT, A and B random (seeded), eval mode. saved: PEFT's
    modules_to_save (tie: ensure_weight_tying); each trained copy gets a random perturbation (else it
    equals the base)."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with warnings.catch_warnings():  # PEFT warns that a tied head in modules_to_save is untied: what we test
        warnings.simplefilter("ignore")
        peft = get_peft_model(hf, LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets,
                                             modules_to_save=saved, ensure_weight_tying=tie))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return peft.eval()


def _ours(path, targets, peft, saved=(), tie=False):
    from peft import get_peft_model_state_dict

    model = load_pretrained(path, dtype=torch.float32)
    add_lora(model, LoraSpec(r=R, alpha=ALPHA, dropout=0.0, targets=targets, modules_to_save=saved,
                             ensure_weight_tying=tie))
    load_peft_tensors(model, get_peft_model_state_dict(peft))
    return model


def _peft_grads(peft) -> dict:
    return {n.replace(".default", ""): p.grad for n, p in peft.named_parameters() if "lora_" in n}


def _our_grads(model) -> dict:
    out = {}
    for i, proj, adapter in _adapter_slots(model):
        for a_name, b_name, a_rows, b_block in _pieces(i, proj, adapter):
            out[a_name], out[b_name] = adapter.lora_A.grad[a_rows], adapter.lora_B.grad[b_block]
    return out


CASES = [(name, t) for name in ("qwen3", "llama3") for t in TARGET_SETS] + [("qwen2_bias", "all")]  # biases: once


@pytest.mark.parametrize("name,targets", CASES, ids=[f"{n}-{t}" for n, t in CASES])
def test_forward_and_gradients_match_peft(checkpoints, name, targets):
    path, target_list = checkpoints[name], TARGET_SETS[targets]
    peft = _peft_model(path, target_list, seed=len(name) + len(targets))
    ours = _ours(path, target_list, peft)
    assert sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n) == lora_param_count(
        ours.config, ours.lora)
    assert all(not p.requires_grad for n, p in ours.named_parameters() if ".lora_" not in n)
    ids = torch.randint(0, peft.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    ref = peft(ids).logits
    got = ours(ids)
    assert (got - ref).abs().max().item() < 1e-4
    with torch.no_grad():
        base = ours(ids)
        with adapters_disabled(ours):
            off = ours(ids)
        assert (base - off).abs().max().item() > 1e-2, "the adapters do not move the logits: the test is vacuous"
        assert (ours(ids, fast=True) - ref).abs().max().item() < 1e-4
    # gradients of one shared upstream gradient, every adapter tensor
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    (ref * g).sum().backward()
    (got * g).sum().backward()
    want, have = _peft_grads(peft), _our_grads(ours)
    assert set(want) == set(have)
    for k in want:  # fp32 sums over T*V terms in different orders: error relative to the tensor's scale
        scale = want[k].abs().max().item()
        assert scale > 0 and (have[k] - want[k]).abs().max().item() < 1e-5 * scale, k
    for a in adapters(ours):  # the block-diagonal zeros of B get no gradient
        assert torch.equal(a.lora_B.grad * (1 - a.mask), torch.zeros_like(a.lora_B))


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_batch_invariant_path_matches_peft(checkpoints, name):
    path = checkpoints[name]
    peft = _peft_model(path, "all-linear", seed=3)
    ours = _ours(path, "all-linear", peft)
    ours.batch_invariant = True
    ids = torch.randint(0, peft.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = peft(ids).logits
        assert (ours(ids) - ref).abs().max().item() < 1e-4
        assert (ours(ids, fast=True) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["qwen2_bias", "qwen3"], ids=["tied", "untied"])
def test_trained_head_matches_peft_modules_to_save(checkpoints, name):
    path = checkpoints[name]
    peft = _peft_model(path, ["q_proj", "down_proj"], seed=11, saved=["lm_head"])
    ours = _ours(path, ["q_proj", "down_proj"], peft, saved=("lm_head",))
    base = load_pretrained(path, dtype=torch.float32)
    assert base.config.tie_word_embeddings == (name == "qwen2_bias")
    trainable = [p for p in ours.parameters() if p.requires_grad]
    assert sum(p.numel() for p in peft.parameters() if p.requires_grad) == lora_param_count(ours.config, ours.lora)
    assert sum(p.numel() for p in trainable) == lora_stored_count(ours.config, ours.lora)
    assert trainable == lora_parameters(ours) and trainable[-1] is ours.lm_head.weight
    ids = torch.randint(0, peft.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(12))
    ref, got = peft(ids).logits, ours(ids)
    assert (got - ref).abs().max().item() < 1e-4
    with torch.no_grad():
        assert (ours(ids, fast=True) - ref).abs().max().item() < 1e-4
        without_head = _ours(path, ["q_proj", "down_proj"], _peft_model(path, ["q_proj", "down_proj"], seed=11))
        assert (without_head(ids) - got).abs().max().item() > 1e-3, "the trained head does not count: vacuous"
        with adapters_disabled(ours):  # the KL reference: the base head (and the base embeddings)
            assert torch.equal(ours(ids), base(ids))
    assert torch.equal(ours.model.embed_tokens.weight, base.model.embed_tokens.weight)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(13))
    (ref * g).sum().backward()
    (got * g).sum().backward()
    want = peft.base_model.model.lm_head.modules_to_save["default"].weight.grad
    scale = want.abs().max().item()
    assert scale > 0 and (ours.lm_head.weight.grad - want).abs().max().item() < 1e-5 * scale
    assert ours.model.embed_tokens.weight.grad is None


@pytest.mark.parametrize("name", ["qwen2_bias", "qwen3"], ids=["tied", "untied"])
def test_trained_embeddings_match_peft_with_weight_tying(checkpoints, name, tmp_path):
    """modules_to_save = [embed_tokens, lm_head], ensure_weight_tying: on a tied base one trained copy that the
    embeddings and the head share (PEFT ties them), on an untied base two copies. Logits, the copies' gradients
    and trainable counts equal PEFT's; adapters off is the base; our saved adapter loads in PEFT and PEFT's in
    ours with the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlengine.model.lora_peft import load_lora, save_adapter

    path, targets, saved = checkpoints[name], ["q_proj", "down_proj"], ("embed_tokens", "lm_head")
    peft = _peft_model(path, targets, seed=21, saved=list(saved), tie=True)
    ours = _ours(path, targets, peft, saved=saved, tie=True)
    base = load_pretrained(path, dtype=torch.float32)
    tied = name == "qwen2_bias"
    assert base.config.tie_word_embeddings == tied and ours.lora.ties(ours.config) == tied
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    trainable = [p for p in ours.parameters() if p.requires_grad]
    assert sum(p.numel() for p in peft.parameters() if p.requires_grad) == lora_param_count(ours.config, ours.lora)
    assert sorted(map(id, trainable)) == sorted(map(id, lora_parameters(ours)))  # a tied copy once
    assert sum(p.numel() for p in trainable) == lora_stored_count(ours.config, ours.lora)
    # HF's embeddings give the pad row no gradient (padding_idx); rlengine packs without padding: ids avoid it
    ids = torch.randint(0, peft.config.vocab_size - 1, (2, 10), generator=torch.Generator().manual_seed(22))
    ids += (ids >= peft.config.pad_token_id).long() if peft.config.pad_token_id is not None else 0
    ref, got = peft(ids).logits, ours(ids)
    assert (got - ref).abs().max().item() < 1e-4
    with torch.no_grad():
        assert (ours(ids, fast=True) - ref).abs().max().item() < 1e-4
        with adapters_disabled(ours):
            assert torch.equal(ours(ids), base(ids))
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(23))
    (ref * g).sum().backward()
    (got * g).sum().backward()
    wrapped = peft.base_model.model
    for mine, theirs in ((ours.model.embed_tokens, wrapped.model.embed_tokens), (ours.lm_head, wrapped.lm_head)):
        want = theirs.modules_to_save["default"].weight.grad
        scale = want.abs().max().item()  # tied: the embedding rows' gradient plus the head's, in both
        assert scale > 0 and (mine.weight.grad - want).abs().max().item() < 1e-5 * scale
    save_adapter(ours, tmp_path / "ours", base_model=str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        assert (PeftModel.from_pretrained(hf, str(tmp_path / "ours")).eval()(ids).logits - ref).abs().max() < 1e-4
        peft.save_pretrained(str(tmp_path / "theirs"))
        theirs = load_pretrained(path, dtype=torch.float32)
        load_lora(theirs, tmp_path / "theirs")
        assert (theirs(ids) - ref).abs().max().item() < 1e-4
        ours.model.embed_tokens.modules_to_save.weight.copy_(base.model.embed_tokens.weight)
        assert (ours(ids) - ref).abs().max().item() > 1e-3, "the trained embeddings do not count: vacuous"


def test_adapters_off_is_the_base_model(checkpoints):
    path = checkpoints["qwen3"]
    peft = _peft_model(path, "all-linear", seed=8)
    ours = _ours(path, "all-linear", peft)
    base = load_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, peft.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), adapters_disabled(ours):
        assert torch.equal(ours(ids), base(ids))
        assert torch.equal(ours(ids, fast=True), base(ids, fast=True))
    assert all(a.enabled for a in adapters(ours))


def test_peft_round_trip_and_init(checkpoints):
    """Our tensors -> PEFT names -> our tensors is the identity; a fresh adapter is PEFT-initialised (B = 0:
    the base model's logits; A uniform within 1/sqrt(C))."""
    path = checkpoints["llama3"]
    model = load_pretrained(path, dtype=torch.float32)
    base = model(torch.arange(5)[None]).detach()
    add_lora(model, LoraSpec(r=R, alpha=ALPHA, targets="all-linear"), seed=1)
    assert torch.equal(model(torch.arange(5)[None]).detach(), base)
    for a in adapters(model):
        bound = a.lora_A.shape[1] ** -0.5
        assert a.lora_A.abs().max() <= bound and a.lora_A.abs().max() > 0.5 * bound
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape))
    tensors = peft_tensors(model)
    other = load_pretrained(path, dtype=torch.float32)
    add_lora(other, LoraSpec(r=R, alpha=ALPHA, targets="all-linear"), seed=2)
    load_peft_tensors(other, tensors)
    for a, b in zip(adapters(model), adapters(other)):
        assert torch.equal(a.lora_A, b.lora_A) and torch.equal(a.lora_B * a.mask, b.lora_B)


@pytest.mark.parametrize("kwargs,match", [
    (dict(r=0, alpha=8.0), "model.lora_r"),
    (dict(r=4, alpha=8.0, targets=("q_proj", "qkv_proj")), "unknown target module"),
    (dict(r=4, alpha=8.0, targets=()), "lora_target_modules"),
    (dict(r=4, alpha=8.0, dropout=1.0), "model.lora_dropout"),
    (dict(r=4, alpha=8.0, modules_to_save=("norm",)), "model.lora_modules_to_save"),
])
def test_bad_specs(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LoraSpec(**kwargs)


def test_moe_experts_refused():
    from rlengine.model.config import ModelConfig
    from rlengine.model.qwen3 import Qwen3ForCausalLM

    hf = make_hf_model("moe", MOE_CONFIGS["moe_top2_norm"], layers=1)
    model = Qwen3ForCausalLM(ModelConfig.from_hf_dict(hf.config.to_dict()))
    with pytest.raises(ConfigError, match="MoE experts"):
        add_lora(model, LoraSpec(r=2, alpha=4.0, targets="all-linear"))
    add_lora(model, LoraSpec(r=2, alpha=4.0, targets=("q_proj", "o_proj")))  # attention of an MoE model: fine
    assert len(adapters(model)) == 2
