"""tools/copy_attention.py against uniform attention, where both figures are known in closed form."""

from __future__ import annotations

import math

import torch

from tools.copy_attention import head_stats


def test_uniform_attention_gives_the_closed_form_figures(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # q = k = 0: every query spreads evenly over the keys it can see
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
            layer.self_attn.k_proj.weight.zero_()
    model.save_pretrained(tmp_path)
    stats = head_stats(str(tmp_path), prompts=2)
    assert set(stats) == {f"layer{i}.head{h}" for i in range(2) for h in range(2)}
    # slot t's query sits at position 24 + t and sees 25 + t keys
    weight = sum(1 / (25 + t) for t in range(24)) / 24
    entropy = sum(math.log(25 + t) for t in range(24)) / 24
    for st in stats.values():
        assert abs(st["weight_on_copy_offset"] - weight) < 1e-4
        assert abs(st["entropy_nats"] - entropy) < 1e-3
