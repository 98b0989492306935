"""A standalone LLM's defaults on a CPU: the KV pool's size, and which tokenizer a checkpoint directory gets."""

import dataclasses

import pytest

from rlengine import LLM, SamplingParams
from rlengine.model.config import ConfigError, preset
from rlengine.engine.kv_cache import bytes_per_block
from rlengine.engine.llm import DEFAULT_CPU_KV_BYTES
from rlengine.model import Qwen3ForCausalLM, save_pretrained
from rlengine.model.tokenizer import Tokenizer


def test_cpu_pool_holds_max_num_seqs_full_length_sequences_when_that_is_small():
    model = Qwen3ForCausalLM(preset("tiny"))
    llm = LLM(model, max_num_seqs=8, block_size=16)
    want = 8 * -(-model.config.max_position_embeddings // 16)  # every sequence at max_model_len
    assert llm.block_manager.num_blocks == want


def test_cpu_pool_is_capped_at_the_documented_default():
    # 16 KiB of K/V per token (2 layers x 8 KV heads x D 128, fp32): 256 MiB hold 16384 tokens
    cfg = dataclasses.replace(preset("tiny"), max_position_embeddings=40960, num_attention_heads=8,
                              num_key_value_heads=8, head_dim=128)
    model = Qwen3ForCausalLM(cfg)
    per_block = bytes_per_block(cfg, 16, model.dtype)
    llm = LLM(model, max_num_seqs=64, block_size=16)
    assert DEFAULT_CPU_KV_BYTES == 256 * 2**20                   # the documented default (llm.py, README)
    assert 64 * 40960 // 16 * per_block > DEFAULT_CPU_KV_BYTES  # the full-length need is over the cap
    assert llm.block_manager.num_blocks == (256 * 2**20) // per_block
    assert llm.kv_cache.data.numel() * llm.kv_cache.data.element_size() <= DEFAULT_CPU_KV_BYTES + 2 * per_block
    out = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(temperature=0, max_tokens=5))
    assert len(out[0].outputs[0].token_ids) == 5
    # a request longer than the capped pool is refused up front, naming the knobs and the default
    with pytest.raises(ValueError, match="raise num_kv_blocks / kv_cache_memory .*256 MiB"):
        llm.generate([[3] * 17000], SamplingParams(max_tokens=10))


@pytest.fixture(scope="module")
def big_vocab_dir(tmp_path_factory):
    """A checkpoint with weights, a 8192-token vocabulary and no tokenizer files."""
    path = tmp_path_factory.mktemp("big_vocab") / "ckpt"
    save_pretrained(Qwen3ForCausalLM(dataclasses.replace(preset("tiny"), vocab_size=8192)), path)
    return path


def test_builtin_tokenizer_is_refused_for_a_large_vocabulary(big_vocab_dir):
    with pytest.raises(ConfigError, match=r"vocabulary is 8192 tokens; the built-in tokenizer .* has 51"):
        LLM(str(big_vocab_dir))


def test_an_explicit_tokenizer_is_taken_as_given(big_vocab_dir):
    llm = LLM(str(big_vocab_dir), tokenizer=Tokenizer.builtin())
    out = llm.generate(["12+3="], SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_small_vocabulary_checkpoint_keeps_the_builtin_tokenizer(tmp_path):
    save_pretrained(Qwen3ForCausalLM(preset("tiny")), tmp_path / "tiny")  # V = 256: a preset's own padding
    assert LLM(str(tmp_path / "tiny")).tokenizer.vocab_size == Tokenizer.builtin().vocab_size
