"""Building blocks of the decoder (Qwen3, Qwen2, Llama 3): RMSNorm, rotary embedding, SwiGLU MLP.

Numerics follow Hugging Face's Qwen3 / Qwen2 / Llama exactly (RMSNorm upcasts to fp32 and casts
back before the weight multiply; RoPE tables, llama3 rule included, are computed in fp32 and cast
to the activation dtype), so logits agree with transformers to fp32 rounding. These modules are the differentiable torch
path; the engine's fused inference path (qwen3.FusedOps) calls its kernels with their weights. On the CPU,
RMSNorm and SiLU * up run as autograd Functions over the C++ kernels (model/train_ops.py): the same
expressions, with one-pass backwards.

Dimension legend: T tokens, C hidden, H / Hkv heads, D head dim, F FFN.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rlengine.model import train_ops
from rlengine.model.config import ConfigError, ModelConfig


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
        return train_ops.rms_norm(x, self.weight, self.eps, rms_norm_ref)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_pos, D] (fp32), indexed by absolute positions; rotate-half layout.

    RoPE kinds (cfg.rope_type): default; linear (positions divided by factor); llama3 (Llama 3.1's
    per-frequency rule, llama3_inv_freq). Tables stay fp32 whatever the model dtype.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.theta = cfg.rope_theta
        self.max_pos = cfg.max_position_embeddings
        self.rope_type = cfg.rope_type
        if self.rope_type not in ("default", "linear", "llama3"):  # ModelConfig rejects these already
            raise ConfigError(f"RotaryEmbedding: rope_type {self.rope_type!r} is not supported")
        self.scaling = dict(cfg.rope_scaling or {})
        self.linear_factor = float(self.scaling.get("factor", 1.0)) if self.rope_type == "linear" else 1.0
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        """[D/2] fp32 inverse frequencies theta^(-2i/D), rescaled by the llama3 rule if configured."""
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        if self.rope_type == "llama3":
            s = self.scaling
            inv_freq = llama3_inv_freq(inv_freq, float(s["factor"]), float(s["low_freq_factor"]),
                                       float(s["high_freq_factor"]), int(s["original_max_position_embeddings"]))
        return inv_freq

    def build(self, device: torch.device) -> None:
        """(Re)compute the tables on `device`; called at construction and after meta-device loading."""
        pos = torch.arange(self.max_pos, device=device, dtype=torch.float32) / self.linear_factor
        freqs = torch.outer(pos, self.inv_freq(device))
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


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_pos: int) -> torch.Tensor:
    """Llama 3.1 RoPE scaling of fp32 inverse frequencies [D/2] by wavelength band.

    Wavelengths shorter than original_max_pos / high_freq_factor (high frequencies) are kept,
    longer than original_max_pos / low_freq_factor are slowed by `factor` (positional
    interpolation), and the band between blends the two linearly in original_max_pos / wavelength.
    """
    wavelen = 2 * math.pi / inv_freq
    short_wavelen = original_max_pos / high_freq_factor
    long_wavelen = original_max_pos / low_freq_factor
    slowed = inv_freq / factor
    # blend weight 1 at the short end of the band, 0 at the long end
    blend = (original_max_pos / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * slowed + blend * inv_freq
    out = torch.where(wavelen > long_wavelen, slowed, blended)
    return torch.where(wavelen < short_wavelen, inv_freq, out)


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
        self.gate_up_lora = self.down_lora = None  # LoRA adapters (model/lora.py add_lora), if any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if self.gate_up_lora is not None:
            gu = self.gate_up_lora(x, gu)
        a = train_ops.silu_and_mul(gu)
        out = self.down_proj(a)
        return out if self.down_lora is None else self.down_lora(a, out)

    def forward_fused(self, x: torch.Tensor, linear, silu_and_mul, lora=None) -> torch.Tensor:
        """The no-grad fast path with the device's kernels (FusedOps.linear / .silu_and_mul / .lora)."""
        w_gu, w_down = self.gate_up_proj.weight, self.down_proj.weight
        gu = linear(x, w_gu) if self.gate_up_lora is None else self.gate_up_lora.project(x, w_gu, linear, lora)
        a = silu_and_mul(gu)
        return linear(a, w_down) if self.down_lora is None else self.down_lora.project(a, w_down, linear, lora)
