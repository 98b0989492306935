"""Building blocks of the Qwen3 decoder: RMSNorm, rotary embedding, SwiGLU MLP.

Numerics follow Hugging Face's Qwen3 exactly (RMSNorm upcasts to fp32 and casts back before
the weight multiply; RoPE tables are computed in fp32 and cast to the activation dtype), so
logits agree with transformers to fp32 rounding. These modules are the differentiable torch
path; the engine's fused inference path (qwen3.FusedOps) calls its kernels with their weights.

Dimension legend: T tokens, C hidden, H / Hkv heads, D head dim, F FFN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlengine.config import ModelConfig


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-torch RMSNorm over the last dim (Hugging Face Qwen3 definition)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_pos, D] (fp32), indexed by absolute positions; rotate-half layout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.theta = cfg.rope_theta
        self.max_pos = cfg.max_position_embeddings
        scaling = cfg.rope_scaling or {}
        self.linear_factor = float(scaling.get("factor", 1.0)) if scaling.get(
            "rope_type", scaling.get("type")) == "linear" else 1.0
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device) -> None:
        """(Re)compute the tables on `device`; called at construction and after meta-device loading."""
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        pos = torch.arange(self.max_pos, device=device, dtype=torch.float32) / self.linear_factor
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos_sin = torch.stack([emb.cos(), emb.sin()])  # [2, max_pos, D]

    def _apply(self, fn, recurse=True):
        # model.to(bf16) would cast the tables too: they stay fp32 (the fused kernels require it, and
        # HF computes RoPE in fp32), so rebuild them on the new device instead of rounding them.
        super()._apply(fn, recurse)
        if self.cos_sin.numel() and self.cos_sin.dtype != torch.float32:
            self.build(self.cos_sin.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int -> (cos, sin) each [T, 1, D] in `dtype`, broadcastable over heads."""
        cs = self.cos_sin[:, positions].to(dtype)
        return cs[0].unsqueeze(1), cs[1].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; rotate-half RoPE (HF layout: first half real, second half imaginary)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SwiGLUMLP(nn.Module):
    """Dense MLP: down(silu(gate(x)) * up(x)); gate and up fused in one [2F, C] weight."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.ffn = ffn
        self.gate_up_proj = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.ffn, dim=-1)
        return self.down_proj(F.silu(gate) * up)
