"""The decoder (Qwen3 dense / MoE, Qwen2 / Qwen2.5, Llama 3.x) that both the generator and the learner run.

One nn.Module tree, one copy of the weights: the engine decodes with these parameters and
the learner optimises them in place. The forward works on PACKED tokens: input_ids [T],
positions [T] and an attention context (rlengine/model/attention.py) that says how tokens
attend (causal per sequence for training and tests, paged KV for the engine). q/k/v and
gate/up projections are fused into single weights (fewer GEMMs on the decode path); the
loader maps them to and from Hugging Face's separate tensors. The three families differ only in
the attention block, switched by the config: q/k RMSNorm (cfg.qk_norm, Qwen3), q/k/v biases
(cfg.attention_bias, Qwen2), and the RoPE tables (cfg.rope_scaling, e.g. llama3).

Dimension legend: B sequences, S sequence length, T packed tokens, C hidden, H / Hkv heads,
D head dim, F FFN, E experts, K top-k, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlengine.model.config import ModelConfig
from rlengine.model import batch_invariant as inv
from rlengine.model import batch_invariant_moe as inv_moe
from rlengine.model import fused_decode
from rlengine.model import train_ops
from rlengine.model import ops as op_dispatch
from rlengine.model.attention import AttentionContext, DenseCausal, PackedCausal
from rlengine.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rope
from rlengine.model.moe import SparseMoeBlock
# The fast path's op dispatch lives in ops.py (re-exported: the learner and tests import them from here).
from rlengine.model.ops import FusedOps, fused_ops_for, logits_fp32, triton_ops  # noqa: F401

class Attention(nn.Module):
    """GQA self-attention; q/k RMSNorm only when cfg.qk_norm (q_norm / k_norm are None otherwise)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.eps = cfg.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.qkv_lora = self.o_lora = None  # LoRA adapters (model/lora.py add_lora), if any

    def _qk_weights(self):
        return (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)

    def forward(self, x_TC, cos, sin, ctx: AttentionContext):
        T = x_TC.shape[0]
        qkv = self.qkv_proj(x_TC)
        if self.qkv_lora is not None:
            qkv = self.qkv_lora(x_TC, qkv)
        qkv_parts = train_ops.qk_norm_rope(qkv, *self._qk_weights(), cos, sin, self.num_heads, self.num_kv_heads,
                                           self.eps)  # the CPU kernels, or None: the torch expressions
        if qkv_parts is None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(T, self.num_heads, self.head_dim)
            k = k.view(T, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            qkv_parts = q, k, v.view(T, self.num_kv_heads, self.head_dim)
        o_THD = ctx.attend(self.layer_id, *qkv_parts)
        o_TC = self.o_proj(o_THD.reshape(T, self.q_size))
        return o_TC if self.o_lora is None else self.o_lora(o_THD.reshape(T, self.q_size), o_TC)

    def forward_fused(self, x_TC, positions_T, rope_table, ctx: AttentionContext, ops: FusedOps,
                      store_kv: bool = False, rows=None):
        """No-grad path: one kernel for q/k RMSNorm (if any) + RoPE straight from the qkv projection;
        store_kv (gen.decode_kernels = "fused"): on decode steps the same kernel stores K/V in the cache.
        rows: the token rows whose output is wanted (Qwen3Model.forward_fused); None: all."""
        T = x_TC.shape[0]
        if self.qkv_lora is not None and self.qkv_proj.bias is None:  # the projection with its adapter
            qkv = self.qkv_lora.project(x_TC, self.qkv_proj.weight, ops.linear, ops.lora)
        else:
            qkv = (ops.linear(x_TC, self.qkv_proj.weight) if self.qkv_proj.bias is None
                   else F.linear(x_TC, self.qkv_proj.weight, self.qkv_proj.bias))
            if self.qkv_lora is not None:
                qkv = self.qkv_lora.fused(x_TC, qkv, ops.linear, ops.lora)
        q_w, k_w = self._qk_weights()
        target = ctx.fused_kv_target(self.layer_id, qkv.dtype) if store_kv else None
        if target is not None:  # the K/V store folded into the q/k-norm + RoPE launch
            q, _ = ops.qk_norm_rope(qkv, q_w, k_w, rope_table, positions_T, self.num_heads, self.num_kv_heads,
                                    self.eps, kv_cache=target)
            o_THD = ctx.attend_stored(self.layer_id, q)
        else:
            q, k = ops.qk_norm_rope(qkv, q_w, k_w, rope_table, positions_T, self.num_heads, self.num_kv_heads,
                                    self.eps)
            v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
            o_THD = ctx.attend(self.layer_id, q, k, v)
        o = o_THD.reshape(T, self.q_size)
        if rows is not None:
            o = o[rows]
        if self.o_lora is None:
            return ops.linear(o, self.o_proj.weight)
        return self.o_lora.project(o, self.o_proj.weight, ops.linear, ops.lora)

    def forward_invariant(self, x_TC, positions_T, rope_table, ctx: AttentionContext):
        """Batch-invariant path (batch_invariant.py): the same structure with the invariant ops."""
        T = x_TC.shape[0]
        qkv = inv.linear(x_TC, self.qkv_proj.weight, self.qkv_proj.bias)
        if self.qkv_lora is not None:
            qkv = self.qkv_lora.invariant(x_TC, qkv, inv.linear)
        q_w, k_w = self._qk_weights()
        q, k = inv.qk_norm_rope(qkv, q_w, k_w, rope_table, positions_T, self.num_heads, self.num_kv_heads, self.eps)
        v = qkv[:, self.q_size + self.kv_size:].reshape(T, self.num_kv_heads, self.head_dim)
        o_THD = ctx.attend(self.layer_id, q, k, v)
        o = o_THD.reshape(T, self.q_size)
        out = inv.linear(o, self.o_proj.weight)
        return out if self.o_lora is None else self.o_lora.invariant(o, out, inv.linear)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, moe_impl: str):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        if cfg.is_moe_layer(layer_id):
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                      cfg.num_experts_per_tok, cfg.norm_topk_prob, moe_impl)
        else:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x_TC, cos, sin, ctx, invariant_rope=None):
        """The torch path; invariant_rope = (positions [T], RoPE table) runs forward_invariant instead
        (through this call, so FSDP's per-layer unshard hooks run in both modes)."""
        if invariant_rope is not None:
            return self.forward_invariant(x_TC, *invariant_rope, ctx)
        x_TC = x_TC + self.self_attn(self.input_layernorm(x_TC), cos, sin, ctx)
        return x_TC + self.mlp(self.post_attention_layernorm(x_TC))

    def forward_fused(self, out_TC, residual_TC, positions_T, rope_table, ctx, ops: FusedOps, store_kv: bool = False,
                      rows=None):
        """vLLM-style residual stream: adds the previous sublayer output into `residual` in place.

        Returns (this layer's MLP output, residual); residual None means out_TC is the embedding.
        store_kv: Attention.forward_fused. rows: attention over every token, then o_proj and the MLP on
        these rows only (both outputs [len(rows), C]).
        """
        if residual_TC is None:
            residual_TC = out_TC
            h = ops.rms_norm(out_TC, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            h = ops.fused_add_rms_norm(out_TC, residual_TC, self.input_layernorm.weight, self.input_layernorm.eps)
        h = self.self_attn.forward_fused(h, positions_T, rope_table, ctx, ops, store_kv, rows)
        if rows is not None:
            residual_TC = residual_TC[rows]  # a copy: the next add writes it in place
        h = ops.fused_add_rms_norm(h, residual_TC, self.post_attention_layernorm.weight,
                                   self.post_attention_layernorm.eps)
        if isinstance(self.mlp, SwiGLUMLP):
            h = self.mlp.forward_fused(h, ops.linear, ops.silu_and_mul, ops.lora)
        else:
            h = self.mlp(h)
        return h, residual_TC

    def _mlp_invariant(self, h):
        mlp = self.mlp
        gu = inv.linear(h, mlp.gate_up_proj.weight)
        if mlp.gate_up_lora is not None:
            gu = mlp.gate_up_lora.invariant(h, gu, inv.linear)
        a = inv.silu_and_mul(gu)
        out = inv.linear(a, mlp.down_proj.weight)
        return out if mlp.down_lora is None else mlp.down_lora.invariant(a, out, inv.linear)

    def forward_invariant(self, x_TC, positions_T, rope_table, ctx):
        """Batch-invariant path: x + attn(norm(x)), then + mlp(norm(.)), every op row-invariant."""
        h = inv.rms_norm(x_TC, self.input_layernorm.weight, self.input_layernorm.eps)
        x_TC = x_TC + self.self_attn.forward_invariant(h, positions_T, rope_table, ctx)
        h = inv.rms_norm(x_TC, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        if isinstance(self.mlp, SwiGLUMLP):
            h = self._mlp_invariant(h)
        else:
            h = inv_moe.moe_block(self.mlp, h)
        return x_TC + h


class Qwen3Model(nn.Module):
    """Embedding, decoder layers, final norm: input_ids [T] -> hidden [T, C]."""

    def __init__(self, cfg: ModelConfig, moe_impl: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, moe_impl) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        self.batch_invariant = False  # Qwen3ForCausalLM.batch_invariant sets it (checked there)

    def forward(self, input_ids_T, positions_T, ctx: AttentionContext, *, fast: bool = False,
                checkpoint_layers: bool = False, rows=None):
        """fast=True: the engine's inference path (fused kernels of fused_ops_for, no autograd; the
        torch path where a device has none). fast=False: the differentiable torch path.
        checkpoint_layers (torch path, with autograd on): each decoder layer keeps only its input and
        runs again in the backward (torch.utils.checkpoint, non-reentrant): the same gradients, the
        activations of one layer at a time instead of all of them. rows (int64 [R]): return only these
        token rows, [R, C]; the fused path then skips the last layer's o_proj and MLP on the others."""
        x_TC = self.embed_tokens(input_ids_T)
        if self.batch_invariant:  # both sides, engine and learner: one implementation per op
            out = self.forward_invariant(x_TC, positions_T, ctx, checkpoint_layers and torch.is_grad_enabled())
            return out if rows is None else out[rows]
        ops = fused_ops_for(x_TC.device) if fast and x_TC.dtype != torch.float64 else None  # fp64: torch ops
        if ops is not None:
            if torch.is_grad_enabled() and x_TC.requires_grad:
                raise RuntimeError("the fused inference path (fast=True) has no autograd; run it under "
                                   "torch.no_grad() / inference_mode, or use fast=False")
            return self.forward_fused(x_TC, positions_T, ctx, ops, rows)
        cos, sin = self.rotary(positions_T, x_TC.dtype)
        recompute = checkpoint_layers and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                x_TC = checkpoint(layer, x_TC, cos, sin, ctx, use_reentrant=False)
            else:
                x_TC = layer(x_TC, cos, sin, ctx)
        return self.norm(x_TC if rows is None else x_TC[rows])  # the norm is per row

    def forward_invariant(self, x_TC, positions_T, ctx, recompute: bool):
        """The batch-invariant path (model/batch_invariant.py), with or without autograd."""
        rope = (positions_T, self.rotary.cos_sin)
        for layer in self.layers:
            if recompute:
                x_TC = checkpoint(layer, x_TC, None, None, ctx, rope, use_reentrant=False)
            else:
                x_TC = layer(x_TC, None, None, ctx, rope)
        return inv.rms_norm(x_TC, self.norm.weight, self.norm.eps)

    def forward_fused(self, x_TC, positions_T, ctx, ops: FusedOps, rows=None):
        """The no-grad fast path on embeddings x_TC, with the kernels in `ops` (fused_ops_for). An engine
        context whose decode_kernels is "fused" (gen.decode_kernels) runs model/fused_decode.py's layer
        on the Triton ops: six launches a layer where it applies, else this loop with the K/V store folded in.
        rows: only these output rows. Every layer's K/V is still computed (and stored) for every token, but
        nothing reads the last layer's other outputs, so its o_proj, MLP and the final norm run on `rows`
        (a prefill that samples one row a sequence skips most of a layer's GEMMs)."""
        fused = ops.stores_kv and getattr(ctx, "decode_kernels", "torch") == "fused"
        if fused and fused_decode.six_launch_ok(self, x_TC, ctx):
            out = fused_decode.forward(self, x_TC, positions_T, ctx, ops)
            return out if rows is None else out[rows]
        out, residual = x_TC, None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            out, residual = layer.forward_fused(out, residual, positions_T, self.rotary.cos_sin, ctx, ops, fused,
                                                rows if i == last else None)
        return ops.fused_add_rms_norm(out, residual, self.norm.weight, self.norm.eps)


class Qwen3ForCausalLM(nn.Module):
    """Causal LM for Qwen3 / Qwen3-MoE, Qwen2 / Qwen2.5 and Llama 3.x (cfg.model_type picks the family).

    Build with `Qwen3ForCausalLM(cfg)` (random init) or load_pretrained(). The name is historical.
    """

    def __init__(self, cfg: ModelConfig, *, moe_impl: str = "ref", device=None, dtype=None, seed: int | None = 0):
        super().__init__()
        self.config = cfg
        self.moe_impl = moe_impl
        self.model = Qwen3Model(cfg, moe_impl)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)
        if seed is not None and not self.lm_head.weight.is_meta:
            self.init_weights(seed)
        self.build_buffers()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def batch_invariant(self) -> bool:
        """Batch-invariant mode (model/batch_invariant.py): the engine's forward and the learner's give
        each token the same bits whatever the batch. Setting True raises ValueError where it cannot run."""
        return self.model.batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        reason = inv.unsupported_reason(self.config, self.device, self.dtype) if on else None
        if reason:
            raise ValueError(f"batch_invariant: {reason}")
        self.model.batch_invariant = bool(on)

    def _causal(self, cu: list[int]):
        scale = self.config.head_dim ** -0.5
        return inv.InvariantCausal(cu, scale) if self.model.batch_invariant else PackedCausal(cu, scale)

    def build_buffers(self) -> None:
        """Recompute non-parameter buffers (RoPE tables) on the weights' device."""
        if not self.lm_head.weight.is_meta:
            self.model.rotary.build(self.device)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init like HF (normal(0, std) for matrices, ones for norms), reproducible from `seed`."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    def hidden_states(self, input_ids_T, positions_T, ctx: AttentionContext, *, fast: bool = False,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
        """Packed forward without the LM head: [T] -> [T, C]. fast: the engine's fused no-grad path.
        rows: only these token rows, [R, C] (the rows a prefill samples; Qwen3Model.forward)."""
        return self.model(input_ids_T, positions_T, ctx, fast=fast, rows=rows)

    def compute_logits(self, hidden_TC: torch.Tensor) -> torch.Tensor:
        """The engine's logits of the sampled rows: [B, C] -> [B, V] fp32, no autograd.

        Accumulated in fp32 from the compute-dtype weights and returned in fp32 (never rounded to
        bf16: rounding alone moves a log-prob by 0.04-0.08 nats at |logit| 10-20), which is what
        the learner's fused log-prob kernel computes from the same hidden states and weights.
        """
        w = self.lm_head.weight
        if self.model.batch_invariant:
            return inv.logits(hidden_TC, w)
        if hidden_TC.shape[0] == 0 or (w.dtype == torch.float32 and hidden_TC.device.type != "cpu"):
            return F.linear(hidden_TC, w)
        return logits_fp32(hidden_TC, w, engine=True)

    def forward(self, input_ids_BS: torch.Tensor, *, cu_seqlens: list[int] | None = None, head=None,
                fast: bool = False, checkpoint_layers: bool = False):
        """Plain causal forward, no cache: input_ids [B, S] -> logits [B, S, V] (fast: fused no-grad path).

        With cu_seqlens: the packed forward of input_ids [T] (forward_packed); `head(hidden_TC, W_VC)`,
        when given, replaces the LM head (the learner's log-prob kernel). The learner calls this
        entry point so that DDP / FSDP wrappers see its forward. checkpoint_layers: Qwen3Model.forward
        (packed path only).
        """
        if cu_seqlens is not None:
            kw = dict(fast=fast, checkpoint_layers=checkpoint_layers)
            if head is None:
                return self.forward_packed(input_ids_BS, cu_seqlens, **kw)
            return head(self.forward_packed(input_ids_BS, cu_seqlens, return_hidden=True, **kw), self.lm_head.weight)
        B, S = input_ids_BS.shape
        positions = torch.arange(S, device=input_ids_BS.device).repeat(B)
        if self.model.batch_invariant:
            ctx = self._causal(list(range(0, B * S + 1, S)))
        else:
            ctx = DenseCausal(B, S, self.config.head_dim ** -0.5)
        hidden = self.model(input_ids_BS.reshape(-1), positions, ctx, fast=fast)
        if self.model.batch_invariant:
            return inv.linear(hidden, self.lm_head.weight).view(B, S, -1)
        return self.lm_head(hidden).view(B, S, -1)

    def forward_packed(self, input_ids_T: torch.Tensor, cu_seqlens: list[int] | torch.Tensor,
                       *, return_hidden: bool = False, fast: bool = False,
                       checkpoint_layers: bool = False) -> torch.Tensor:
        """Variable-length causal forward: sequences packed along T with boundaries cu_seqlens [B+1].

        Returns logits [T, V], or hidden states [T, C] with return_hidden (for the fused log-prob).
        fast=True runs the engine's fused no-grad path (for parity checks against the learner's).
        Host sync: cu_seqlens is read on the host if given as a tensor.
        """
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        if cu[0] != 0 or cu[-1] != input_ids_T.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T={input_ids_T.shape[0]}, got {cu}")
        positions = torch.cat([torch.arange(b - a, device=input_ids_T.device) for a, b in zip(cu, cu[1:])])
        hidden = self.model(input_ids_T, positions, self._causal(cu), fast=fast, checkpoint_layers=checkpoint_layers)
        if return_hidden:
            return hidden
        return inv.linear(hidden, self.lm_head.weight) if self.model.batch_invariant else self.lm_head(hidden)

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
