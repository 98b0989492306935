"""The one place that maps rlengine parameter names to Hugging Face checkpoint tensors.

rlengine fuses q/k/v into qkv_proj, gate/up into gate_up_proj, and stacks experts into
w13 [E, 2F, C] / w2 [E, C, F]; Hugging Face checkpoints store them separately (per expert,
the hub format that transformers writes). Each rlengine parameter maps to a list of HF
tensor names concatenated along dim 0 (or stacked over experts, for w13 / w2). Qwen3, Qwen2 and
Llama share these names; they differ only in which tensors exist (q/k norms, q/k/v biases).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlengine.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """How one rlengine parameter is assembled from HF tensors."""

    hf_names: tuple[str, ...]   # concatenated along dim 0, in this order
    stack_experts: int = 0      # > 0: hf_names hold E groups of equal length, each group is one expert
    # transformers-5 fused-expert tensor name accepted as an alternative source (already stacked)
    fused_name: str | None = None


def weight_map(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """rlengine parameter name -> WeightSpec, for every parameter the model owns."""
    specs: dict[str, WeightSpec] = {"model.embed_tokens.weight": WeightSpec(("model.embed_tokens.weight",)),
                                    "model.norm.weight": WeightSpec(("model.norm.weight",))}
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = WeightSpec(("lm_head.weight",))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        specs[f"{a}.qkv_proj.weight"] = WeightSpec((f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"))
        if cfg.attention_bias:
            specs[f"{a}.qkv_proj.bias"] = WeightSpec((f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias"))
        specs[f"{a}.o_proj.weight"] = WeightSpec((f"{a}.o_proj.weight",))
        if cfg.qk_norm:  # Qwen3 only; Qwen2 / Llama checkpoints have no such tensors
            specs[f"{a}.q_norm.weight"] = WeightSpec((f"{a}.q_norm.weight",))
            specs[f"{a}.k_norm.weight"] = WeightSpec((f"{a}.k_norm.weight",))
        specs[f"{p}.input_layernorm.weight"] = WeightSpec((f"{p}.input_layernorm.weight",))
        specs[f"{p}.post_attention_layernorm.weight"] = WeightSpec((f"{p}.post_attention_layernorm.weight",))
        m = f"{p}.mlp"
        if cfg.is_moe_layer(i):
            E = cfg.num_experts
            specs[f"{m}.gate.weight"] = WeightSpec((f"{m}.gate.weight",))
            specs[f"{m}.w13"] = WeightSpec(
                tuple(n for e in range(E) for n in (f"{m}.experts.{e}.gate_proj.weight", f"{m}.experts.{e}.up_proj.weight")),
                stack_experts=E, fused_name=f"{m}.experts.gate_up_proj")
            specs[f"{m}.w2"] = WeightSpec(tuple(f"{m}.experts.{e}.down_proj.weight" for e in range(E)),
                                          stack_experts=E, fused_name=f"{m}.experts.down_proj")
        else:
            specs[f"{m}.gate_up_proj.weight"] = WeightSpec((f"{m}.gate_proj.weight", f"{m}.up_proj.weight"))
            specs[f"{m}.down_proj.weight"] = WeightSpec((f"{m}.down_proj.weight",))
    return specs
