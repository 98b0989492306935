"""Bad checkpoints give one clear error naming the file, tensor or field; tokenizer round trip."""

import json

import pytest
from safetensors.torch import save_file

from rlengine.model.config import ConfigError, ModelConfig, preset
from rlengine.model import CheckpointError, load_pretrained
from rlengine.model.tokenizer import Tokenizer

from tests.support.hf_models import DENSE_CONFIGS, make_hf_model, save_hf_model


@pytest.fixture()
def ckpt(tmp_path):
    return save_hf_model(make_hf_model("dense", DENSE_CONFIGS["dense_gqa2_untied"], layers=2), tmp_path / "ckpt")


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_pretrained(tmp_path / "nope")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_pretrained(ckpt)


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_pretrained(ckpt)


def test_corrupt_weights_file(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_pretrained(ckpt)


def test_missing_shard(tmp_path):
    hf = make_hf_model("dense", DENSE_CONFIGS["dense_gqa2_untied"], layers=2)
    path = save_hf_model(hf, tmp_path / "sharded", max_shard_size="10KB")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_pretrained(path)


def test_missing_tensor(ckpt):
    from safetensors.torch import load_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.k_proj.weight"):
        load_pretrained(ckpt)


def test_shape_mismatch(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] += 1
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"gate_proj.weight.*shape"):
        load_pretrained(ckpt)


def test_unsupported_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture 'LlamaForCausalLM'"):
        load_pretrained(ckpt)


def test_config_missing_field(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["num_attention_heads"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing required field.*num_attention_heads"):
        load_pretrained(ckpt)


@pytest.mark.parametrize("field,value,match", [
    ("num_key_value_heads", 3, "multiple of"),
    ("head_dim", 7, "even"),
    ("hidden_size", 0, "hidden_size"),
])
def test_config_validation_names_field(field, value, match):
    with pytest.raises(ConfigError, match=match):
        preset("tiny").replace(**{field: value})


def test_unknown_preset():
    with pytest.raises(ConfigError, match="known presets"):
        preset("huge")


def test_moe_topk_larger_than_experts():
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        preset("tiny-moe").replace(num_experts_per_tok=9)


def test_hf_dict_round_trip_all_presets():
    from rlengine.model.config import PRESETS

    for name in PRESETS:
        cfg = preset(name)
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_builtin_tokenizer_round_trip(tmp_path):
    tok = Tokenizer.builtin()
    text = "what is 12+34? 46."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert max(ids) < tok.vocab_size <= 256
    tok.save(tmp_path / "tokenizer.json")
    again = Tokenizer.from_file(tmp_path)
    assert again.encode(text) == ids and again.eos_token_id == tok.eos_token_id
