"""The fused decode layer of the GPU path (gen.decode_kernels = "fused"): six launches a dense layer.

A decode step of a small model at B_act <= 64 is bound by its launch chain, not by arithmetic. The
torch setting (today's path) runs ten launches a layer: add+RMSNorm, qkv GEMM, q/k-norm+RoPE,
K/V store, attention, o_proj GEMM, add+RMSNorm, gate_up GEMM, SiLU*up, down GEMM. The fused setting
runs six, on the residual stream kept in one buffer that the two residual epilogues update in place:
  norm+qkv (small_m_gemm.norm_linear)  ->  q/k-norm+RoPE+K/V store (fused_norm.qk_norm_rope kv_cache=)
  -> attention (the backend's decode, attend_stored)  ->  o_proj+residual (linear_residual)
  -> norm+gate_up+SiLU (norm_gate_up_silu)  ->  down+residual (linear_residual)
and the final norm after the last layer. Where the six-launch layer does not apply (prefill, more
than 64 rows, MoE layers, LoRA adapters, the CPU's C++ ops) the fused setting keeps today's layer and
only folds the K/V store into q/k-norm+RoPE on decode steps (nine launches a layer).
The setting's default is "torch" until a GPU run in this repository measures the fused path faster
at B_act 1 and 64 (tools/gpu_check.sh decode2 writes that measurement).
Dimension legend: T tokens (decode: one per sequence), C hidden, H / Hkv heads, D head dim, F FFN.
"""

from __future__ import annotations

import functools

import torch

from rlengine.model.config import ConfigError

DECODE_KERNELS = ("torch", "fused")
DEFAULT_DECODE_KERNELS = "torch"
DEFAULT_REASON = "default until a GPU run measures fused faster"


def check_decode_kernels(value, field: str = "decode_kernels") -> str:
    """value if it names a decode layer path, else ConfigError naming `field` and the choices."""
    if value not in DECODE_KERNELS:
        raise ConfigError(f"{field} must be torch|fused, got {value!r}")
    return value


def describe(setting: str, device_type: str) -> str:
    """One line for `rlengine info` / a run's log: which decode layer path runs and why."""
    why = DEFAULT_REASON if setting == DEFAULT_DECODE_KERNELS else "chosen by the setting"
    where = "" if device_type == "cuda" else "; on a CPU the C++ path runs either way"
    return f"decode kernels: {setting} ({why}{where})"


def six_launch_ok(model, x_TC: torch.Tensor, ctx) -> bool:
    """The six-launch layer applies to this step: a decode step of at most 64 rows whose backend lets a
    kernel store K/V, every layer a dense SwiGLU layer without LoRA, fp16 / bf16 / fp32."""
    from rlengine.kernels.small_m_gemm import MAX_M
    from rlengine.model.layers import SwiGLUMLP

    if not 1 <= x_TC.shape[0] <= MAX_M or x_TC.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if ctx.fused_kv_target(0, x_TC.dtype) is None:
        return False
    return all(isinstance(layer.mlp, SwiGLUMLP) and layer.mlp.gate_up_lora is None and layer.mlp.down_lora is None
               and layer.self_attn.qkv_lora is None and layer.self_attn.o_lora is None for layer in model.layers)


@functools.lru_cache(maxsize=8)
def _workspace(device: torch.device, shapes: tuple[tuple[int, int], ...]):
    """The split-K scratch of one model's projections on `device`, made once (its counters must stay
    zeroed between launches, so it is never reallocated)."""
    from rlengine.kernels.small_m_gemm import SmallMWorkspace

    with torch.inference_mode(False):
        return SmallMWorkspace.for_shapes(list(shapes), device)


def _shapes(model) -> tuple[tuple[int, int], ...]:
    a, C = model.layers[0].self_attn, model.norm.weight.shape[0]
    F = model.layers[0].mlp.gate_up_proj.weight.shape[0] // 2
    return (a.q_size + 2 * a.kv_size, C), (C, a.q_size), (F, C), (C, F)


def prepare(model) -> None:
    """Make the split-K workspace of `model` (a Qwen3Model) now, outside any CUDA-graph capture (a zeroed
    buffer made during capture would add a memset to the graph). The engine calls it at start-up."""
    from rlengine.model.layers import SwiGLUMLP

    if model.layers and isinstance(model.layers[0].mlp, SwiGLUMLP):
        _workspace(model.norm.weight.device, _shapes(model))


def forward(model, x_TC: torch.Tensor, positions_T: torch.Tensor, ctx, ops) -> torch.Tensor:
    """The decoder's hidden states [T, C] from embeddings x_TC [T, C] (overwritten: it becomes the
    residual stream), six launches a layer plus the final norm. No host sync, no allocation beyond
    the step's activations (the split-K workspace is made at the first call)."""
    from rlengine.kernels import small_m_gemm as sm

    ws = _workspace(x_TC.device, _shapes(model))
    residual, T = x_TC, x_TC.shape[0]
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        qkv = sm.norm_linear(residual, ln1.weight, ln1.eps, attn.qkv_proj.weight, attn.qkv_proj.bias, workspace=ws)
        q_w, k_w = (None, None) if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)
        q, _ = ops.qk_norm_rope(qkv, q_w, k_w, model.rotary.cos_sin, positions_T, attn.num_heads, attn.num_kv_heads,
                                attn.eps, kv_cache=ctx.fused_kv_target(attn.layer_id, qkv.dtype))
        o = ctx.attend_stored(attn.layer_id, q).reshape(T, attn.q_size)
        sm.linear_residual(o, attn.o_proj.weight, residual, workspace=ws)
        h = sm.norm_gate_up_silu(residual, ln2.weight, ln2.eps, mlp.gate_up_proj.weight, workspace=ws)
        sm.linear_residual(h, mlp.down_proj.weight, residual, workspace=ws)
    return ops.rms_norm(residual, model.norm.weight, model.norm.eps)
