"""Decode-step roofline (docs/METHOD.md Eq. 5) and KV-cache feasibility (B_KV) from a ModelConfig.

    t_dec(B) >= max{ (M_W(B) + B * m_u) / W_HBM,  B * f_tok / F_eff },   q_tok = B / t_dec

Bytes and FLOPs are counted from the weight shapes of a Qwen3 / Qwen3-MoE decoder. Simplifications,
all small next to the weights and the KV cache: activations are not counted as traffic; the
embedding table is not streamed (only the B rows looked up), the LM head is; norm weights are
streamed but their FLOPs are ignored. For MoE layers under uniform routing, B tokens with top-K
routing touch on average E * (1 - (1 - K/E)^B) distinct experts, and only those are streamed.
All terms are per device: pass a config already divided by tensor parallelism for TP > 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlengine.model.config import ModelConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamCounts:
    """Parameter counts by role (elements, not bytes)."""

    embedding: int         # V*C input table
    lm_head: int           # V*C output projection (streamed every step, tied or not)
    tied: bool             # LM head is the embedding table (stored once)
    attention: int         # q/k/v/o projections (+bias) and q/k norms, all layers
    attention_matmul: int  # the projections alone (what tokens multiply by)
    norms: int             # input/post-attention norms of all layers + final norm
    dense_mlp: int         # gate/up/down of all dense MLP layers
    router: int            # C*E gates of all MoE layers
    expert: int            # one expert's gate/up/down: 3*C*F_moe
    moe_layers: int        # number of MoE layers
    num_experts: int       # E (0 for dense)
    experts_per_tok: int   # K

    @property
    def total(self) -> int:
        """Stored parameters (a tied LM head counted once)."""
        return (self.embedding + (0 if self.tied else self.lm_head) + self.attention + self.norms
                + self.dense_mlp + self.router + self.moe_layers * self.num_experts * self.expert)

    @property
    def active_matmul(self) -> int:
        """Parameters one token multiplies by: projections, dense MLPs, router, K experts, LM head."""
        return (self.attention_matmul + self.dense_mlp + self.router
                + self.moe_layers * self.experts_per_tok * self.expert + self.lm_head)


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Count parameters from the shapes in `cfg`."""
    C, H, Hkv, D, L = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                       cfg.num_hidden_layers)
    proj = C * H * D + 2 * C * Hkv * D + H * D * C
    if cfg.attention_bias:
        proj += H * D + 2 * Hkv * D  # q/k/v biases (o_proj has none in Qwen2 / Qwen3)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(L))
    return ParamCounts(
        embedding=cfg.vocab_size * C, lm_head=cfg.vocab_size * C, tied=cfg.tie_word_embeddings,
        attention=L * (proj + (2 * D if cfg.qk_norm else 0)), attention_matmul=L * proj,  # q/k norms: Qwen3
        norms=2 * L * C + C,
        dense_mlp=(L - moe_layers) * 3 * C * cfg.intermediate_size,
        router=moe_layers * C * cfg.num_experts,
        expert=3 * C * cfg.moe_intermediate_size if cfg.is_moe else 0,
        moe_layers=moe_layers, num_experts=cfg.num_experts, experts_per_tok=cfg.num_experts_per_tok,
    )


def expected_distinct_experts(num_experts: int, top_k: int, b_act: int) -> float:
    """E * (1 - (1 - K/E)^B): distinct experts hit by B tokens routing top-K uniformly at random."""
    if num_experts < 1 or not 1 <= top_k <= num_experts or b_act < 0:
        raise ValueError(f"expected_distinct_experts needs E >= 1, 1 <= K <= E, B >= 0; "
                         f"got E={num_experts}, K={top_k}, B={b_act}")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** b_act)


def weight_bytes_per_step(cfg: ModelConfig, b_act: int, weight_bytes: float = 2) -> float:
    """M_W: weight bytes one decode step of B_act sequences streams from HBM."""
    p = param_counts(cfg)
    elems = p.attention + p.norms + p.dense_mlp + p.router + p.lm_head + b_act * cfg.hidden_size
    if p.moe_layers:
        elems += p.moe_layers * expected_distinct_experts(p.num_experts, p.experts_per_tok, b_act) * p.expert
    return elems * weight_bytes


def kv_bytes_per_seq(cfg: ModelConfig, context_len: int, kv_bytes: float = 2) -> float:
    """m_KV(S) = 2 * L * Hkv * D * S * s_KV: bytes of K and V one sequence of S tokens holds."""
    if context_len < 0 or kv_bytes <= 0:
        raise ValueError(f"kv_bytes_per_seq needs context_len >= 0 and kv_bytes > 0, got {context_len}, {kv_bytes}")
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * context_len * kv_bytes


def seq_bytes_per_step(cfg: ModelConfig, context_len: int, kv_bytes: float = 2) -> float:
    """m_u: per-sequence bytes of one decode step, reading S cached tokens and writing one."""
    return kv_bytes_per_seq(cfg, context_len + 1, kv_bytes)


def flops_per_token(cfg: ModelConfig, context_len: int) -> float:
    """f_tok = 2 * (active matmul parameters) + 4 * L * H * D * S (QK^T and PV over S cached tokens)."""
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context_len
    return 2 * param_counts(cfg).active_matmul + attn


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeRoofline:
    """Lower bound on one decode step at a given B_act and context length."""

    b_act: int                    # B_act: sequences in the step
    context_len: int              # S: cached tokens per sequence
    weight_bytes: float           # M_W(B_act)
    seq_bytes: float              # m_u per sequence
    flops_per_token: float        # f_tok
    t_memory: float               # (M_W + B*m_u) / W_HBM, seconds
    t_compute: float              # B*f_tok / F_eff, seconds
    t_dec: float                  # max of the two
    tokens_per_s: float           # q_tok bound = B / t_dec
    arithmetic_intensity: float   # AI_dec, FLOP/byte
    ridge: float                  # rho = F_eff / W_HBM, FLOP/byte
    bandwidth_bound: bool         # AI_dec < rho


def decode_roofline(cfg: ModelConfig, *, b_act: int, context_len: int, bandwidth: float, flops: float,
                    weight_bytes: float = 2, kv_bytes: float = 2) -> DecodeRoofline:
    """Eq. 5 of docs/METHOD.md for one step. bandwidth W_HBM in bytes/s, flops F_eff in FLOP/s (measured ceilings)."""
    if b_act < 1 or context_len < 0:
        raise ValueError(f"decode_roofline needs b_act >= 1 and context_len >= 0, got {b_act}, {context_len}")
    if bandwidth <= 0 or flops <= 0 or weight_bytes <= 0 or kv_bytes <= 0:
        raise ValueError(f"decode_roofline needs positive bandwidth, flops, weight_bytes and kv_bytes; got "
                         f"{bandwidth}, {flops}, {weight_bytes}, {kv_bytes}")
    m_w = weight_bytes_per_step(cfg, b_act, weight_bytes)
    m_u = seq_bytes_per_step(cfg, context_len, kv_bytes)
    f_tok = flops_per_token(cfg, context_len)
    traffic = m_w + b_act * m_u
    t_mem, t_cmp = traffic / bandwidth, b_act * f_tok / flops
    t_dec = max(t_mem, t_cmp)
    ai = b_act * f_tok / traffic
    return DecodeRoofline(b_act=b_act, context_len=context_len, weight_bytes=m_w, seq_bytes=m_u,
                          flops_per_token=f_tok, t_memory=t_mem, t_compute=t_cmp, t_dec=t_dec,
                          tokens_per_s=b_act / t_dec, arithmetic_intensity=ai, ridge=flops / bandwidth,
                          bandwidth_bound=ai < flops / bandwidth)


def b_kv(alpha: float, c_mem: float, m_weights: float, m_runtime: float, m_kv: float) -> int:
    """B_KV = floor((alpha*C_mem - M_weights - M_runtime) / m_KV(S)); 0 when nothing is left for KV.

    alpha in (0, 1] is the usable fraction of device memory C_mem (bytes); M_weights and M_runtime
    are bytes already taken (M_runtime may be 0); m_kv is kv_bytes_per_seq at the target length.
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"b_kv: alpha must be in (0, 1], got {alpha}")
    for name, value in (("c_mem", c_mem), ("m_weights", m_weights), ("m_kv", m_kv)):
        if not value > 0:
            raise ValueError(f"b_kv: {name} must be > 0 bytes, got {value}")
    if not m_runtime >= 0:
        raise ValueError(f"b_kv: m_runtime must be >= 0 bytes, got {m_runtime}")
    return max(0, math.floor((alpha * c_mem - m_weights - m_runtime) / m_kv))
