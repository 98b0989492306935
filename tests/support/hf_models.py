"""Random tiny Hugging Face Qwen3 / Qwen3-MoE checkpoints, built with transformers' own classes.

These are the references nobody here wrote: tests save them with transformers and load
them with rlengine (and the reverse). Shapes are tiny so every forward is milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import torch

DENSE_CONFIGS = {
    # GQA 4:2, head_dim != hidden/heads, untied, default theta
    "dense_gqa2_untied": dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              intermediate_size=72, tie_word_embeddings=False, rope_theta=10000.0),
    # one KV head (MQA), tied embeddings, large theta
    "dense_mqa_tied": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                           intermediate_size=96, tie_word_embeddings=True, rope_theta=1_000_000.0),
    # no GQA, head_dim 8 (hidden/heads would be 10), odd FFN
    "dense_mha_hd8": dict(hidden_size=40, num_attention_heads=6, num_key_value_heads=6, head_dim=8,
                          intermediate_size=53, tie_word_embeddings=False, rope_theta=500.0),
}

MOE_CONFIGS = {
    # top-2 of 4, norm_topk_prob on, every layer sparse
    "moe_top2_norm": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          intermediate_size=64, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # top-1 of 5, norm off, one dense layer via mlp_only_layers, tied, MQA
    "moe_top1_mlponly": dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                             intermediate_size=40, moe_intermediate_size=16, num_experts=5, num_experts_per_tok=1,
                             norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
                             tie_word_embeddings=True),
    # top-3 of 6, sparse every 2nd layer, norm off, theta 1e6
    "moe_top3_step2": dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                           intermediate_size=56, moe_intermediate_size=20, num_experts=6, num_experts_per_tok=3,
                           norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
                           rope_theta=1_000_000.0),
}


def make_hf_model(kind: str, overrides: dict, *, vocab: int = 97, layers: int = 3, seed: int = 0):
    """A random transformers model (fp32, eval mode)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=512, rms_norm_eps=1e-6)
    common.update(overrides)
    if kind == "moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    # HF's init leaves norms at 1; perturb them so the parity check sees their weights.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def save_hf_model(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(str(path), **kwargs)
    return path


def all_configs():
    return [("dense", k, v) for k, v in DENSE_CONFIGS.items()] + [("moe", k, v) for k, v in MOE_CONFIGS.items()]


# ---- Qwen2 / Qwen2.5 and Llama 3.x (tests/model/test_arch_parity.py) --------------------------
def _llama3_rope(theta: float, factor: float, low: float, high: float, original: int) -> dict:
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}


ARCH_CONFIGS = {
    # Qwen2: q/k/v biases, head_dim = hidden / heads = 12, GQA 4:2, tied embeddings
    "qwen2_gqa_tied": ("qwen2", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=72, tie_word_embeddings=True, rope_theta=10000.0)),
    # Qwen2: one KV head, untied, theta 1e6, odd FFN
    "qwen2_mqa_untied": ("qwen2", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                       intermediate_size=53, tie_word_embeddings=False, rope_theta=1_000_000.0)),
    # Llama 3.1 rope with original_max_position_embeddings 32 (D=16, theta 1e4): frequency 0 kept,
    # 1 blended, 2..7 slowed by 8 -- all three bands of the rule; head_dim 16 != hidden/heads = 12; untied
    "llama3_hd16_untied": ("llama", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         intermediate_size=72, tie_word_embeddings=False,
                                         rope_parameters=_llama3_rope(10000.0, 8.0, 1.0, 4.0, 32))),
    # Llama 3.2-style tied embeddings, head_dim from hidden/heads = 8, GQA 8:2, factor 4
    "llama3_hd8_tied": ("llama", dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                      intermediate_size=96, tie_word_embeddings=True,
                                      rope_parameters=_llama3_rope(10000.0, 4.0, 1.0, 4.0, 64))),
}


def make_hf_arch_model(family: str, overrides: dict, *, vocab: int = 97, layers: int = 2, seed: int = 0):
    """A random transformers Qwen2 or Llama model (fp32, eval), norms perturbed and biases non-zero."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=512, rms_norm_eps=1e-6,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[family]
    model = model_cls(config_cls(**common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("bias"):  # HF initialises biases to zero: make them count
                p.copy_(0.2 * torch.randn_like(p))
    return model.eval()


def random_prompts(n, vocab, max_len, seed=0):
    """n random token-id prompts, one of length 1, one of max_len, the rest uniform in [2, max_len)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [1, max_len] + torch.randint(2, max_len, (n - 2,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n_,), generator=gen).tolist() for n_ in lens]


def hf_greedy(hf, prompt, max_new):
    """transformers' greedy generate() of max_new tokens after `prompt` (no EOS stop): the engine's reference."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # explicit all-ones mask: otherwise generate() masks prompt tokens equal to pad_token_id
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()
