"""The learner's activation memory for one micro-batch, counted tensor by tensor: an upper bound.

What autograd keeps from the forward to the backward (`saved`) is counted from the learner's own
torch path (model/layers.py, model/qwen3.py, model/attention.py, model/moe.py), per token and in
bytes, with s the compute dtype's size and f = 4 (fp32):

  RMSNorm over n features      f n (the fp32 input; for an fp32 model the input itself) + f (rsqrt)
                               + s n (the normalised value, kept for the weight's gradient)
                               + s n (its output, kept by the next projection)
  attention, qkv projection    s (H + 2 Hkv) D: the projection's output (v, and in fp32 the q / k
                               norms' inputs, are views of it)
  q / k RMSNorm (Qwen3)        the norm above over (H + Hkv) D features, fp32 copies in 16-bit
                               models, minus its output (RoPE keeps only cos / sin)
  RoPE outputs                 s (H + Hkv) D (kept by the padded attention layout's index_copy)
  SDPA, per padded token       s (2 H + 2 Hkv) D (padded q, k, v and the output) + f H (log-sum-exp)
  o_proj input                 s H D
  dense MLP                    s 4 F: gate_up's output (2F), silu(gate), silu(gate) * up
  MoE MLP                      router: f E softmax + f K weights + f + 8 K ids and 8 K for their
                               sort order; per routed pair
                               (K per token): the gathered input s C, the expert's 2 F + F + F,
                               its output s C and the fp32 copy index_add keeps (f C), 8 + s
  once per token               ids, positions, padding index and targets (4 x 8), cos / sin
                               (2 s D), the final norm and the head's input

Padded tokens: the learner pads the micro-batch's sequences to its longest (B x S_max rows) for
SDPA; the memory plan, which assumes every sequence at max_model_len, counts micro x S for both.
With train.activation_checkpointing every decoder layer keeps only its input (s C) and one layer's
saved tensors exist at a time, recomputed in the backward.

On top of `saved`, the backward's transient peak (`transient`), the larger of:
- the LM head's backward: grad_h (s C per token) and, chunked torch head (the CPU learner,
  learner/chunked_head.py): one chunk's fp32 grad_W, their fp32 sum when T spans several chunks,
  for a 16-bit model the fp32 head copy and the rounded grad_W (1 to 3 x V C f), and one [T_c, V]
  chunk's logits with their autograd graph (raw: 7 fp32 blocks; processed: 8 with the sort's
  values and int64 ids; the head alone measured 5.0 and 6.3, inside the model up to 6.1 for raw);
  fused Triton head (CUDA, kernels/fused_logprob.py): grad_W (V C s), an fp32 vocab chunk of it (<= V C f), grad_h in
  fp32 (f C per token) and one d(logits) chunk; the batch-invariant head (model/batch_invariant.py),
  which keeps [T, V] fp32 logits, log-softmax and exp (3 T V f saved): their gradients, 3 T V f;
- one decoder layer's gradients: half its saved bytes (the engine frees each node's saved tensors
  as it runs, so a layer's gradients and its saved tensors are never all alive) plus the two
  residual gradients (2 s C), and in an MoE layer per routed pair the fp32 gradient of the
  expert's output, its rounded copy, the gathered input's gradient, index_add's source gradient
  and the forward's fp32 accumulator ((3 f + 2 s) C); checkpointed: the recomputed layer's saved
  tensors as well.

tests/analysis/test_activation_bound.py checks it on random configs of every family against
saved-tensor accounting (saved_tensors_hooks, parameters excluded) and against the measured heap
peak of a forward and backward on the CPU. The CUDA trainer measures the peak instead (see
plan/memory.py), and this estimate is what a plan without a device says.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlengine.model.config import ModelConfig

BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
HEAD_CHUNK_ELEMS = 2**23  # [T_c, V] fp32 elements of one chunk of the chunked torch head (32 MiB)
_F32, _ID = 4, 8           # fp32 and int64 bytes
_CHUNK_BLOCKS = {"raw": 7, "processed": 8}  # [T_c, V] fp32-sized blocks alive in one chunk's backward
_MATERIALIZED_BLOCKS = 3  # [T, V] fp32 blocks the batch-invariant head keeps: logits, log-softmax, exp
HEADS = ("chunked", "fused", "materialized")


@dataclass(frozen=True, slots=True)
class Activations:
    """The learner's activation bytes for one micro-batch: saved by the forward, and the backward's peak on top."""

    saved: int
    transient: int

    @property
    def total(self) -> int:
        return self.saved + self.transient


def head_chunk_tokens(vocab_size: int, chunk_elems: int = HEAD_CHUNK_ELEMS) -> int:
    """Rows per chunk of the chunked torch head: as many as keep one [T_c, V] block at chunk_elems."""
    return max(1, chunk_elems // max(1, vocab_size))


def _norm(n: int, s: int, f: int = _F32) -> int:
    """Bytes an RMSNorm over n features keeps per row, its output included (kept by its consumer)."""
    return max(f, s) * n + f + 2 * s * n


def layer_saved(cfg: ModelConfig, layer: int, s: int, tokens: int, padded_tokens: int) -> int:
    """Bytes one decoder layer's forward keeps for the backward (see the module docstring)."""
    C, H, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_tok = _norm(C, s) + s * (H + 2 * Hkv) * D + s * (H + Hkv) * D + s * H * D
    if cfg.qk_norm:  # q_norm and k_norm: fp32 inputs (the qkv output itself in fp32), their normalised value
        per_tok += (0 if s >= _F32 else _F32 * (H + Hkv) * D) + _F32 * (H + Hkv) + s * (H + Hkv) * D
    per_tok += _norm(C, s)
    if cfg.is_moe_layer(layer):
        K, E, Fm = cfg.num_experts_per_tok, cfg.num_experts, cfg.moe_intermediate_size
        per_tok += _F32 * (E + K + 1) + 2 * _ID * K + K * (2 * s * C + _F32 * C + 4 * s * Fm + _ID + s)
    else:
        per_tok += 4 * s * cfg.intermediate_size
    per_padded = s * (2 * H + 2 * Hkv) * D + _F32 * H
    return tokens * per_tok + padded_tokens * per_padded


def head_transient(cfg: ModelConfig, tokens: int, s: int, *, head: str, mode: str,
                   chunk_elems: int = HEAD_CHUNK_ELEMS) -> int:
    """The LM head backward's peak on top of the saved tensors (see the module docstring)."""
    V, C = cfg.vocab_size, cfg.hidden_size
    grad_h = s * C * tokens
    if head == "fused":  # kernels/fused_logprob.py: grad_W, an fp32 vocab chunk of it, fp32 grad_h, one dz chunk
        return V * C * (s + _F32) + _F32 * C * tokens + grad_h + s * chunk_elems
    if head == "materialized":  # the batch-invariant head: the [T, V] gradients of its saved blocks, fp32 grad_W
        return _MATERIALIZED_BLOCKS * tokens * V * _F32 + V * C * _F32 + grad_h
    rows = min(tokens, head_chunk_tokens(V, chunk_elems))
    # [V, C] fp32 copies: one chunk's grad_W, their sum when there are several chunks, and for a
    # 16-bit model the fp32 head plus the rounded grad_W (half a copy) at the end
    halves = (2 if s >= _F32 else 5) + (2 if tokens > rows else 0)
    return grad_h + halves * V * C * _F32 // 2 + _CHUNK_BLOCKS[mode] * rows * V * _F32


def activation_parts(cfg: ModelConfig, tokens: int, dtype: str, *, padded_tokens: int | None = None,
                     checkpointing: bool = False, head: str = "chunked", mode: str = "raw",
                     chunk_elems: int = HEAD_CHUNK_ELEMS) -> Activations:
    """Activation bytes of the learner's forward + backward over `tokens` packed tokens.

    padded_tokens: the rows the attention pads to (B x S_max; default tokens). head: "chunked" (the
    torch head, learner/chunked_head.py), "fused" (the Triton kernel, raw mode on CUDA) or
    "materialized" (batch-invariant mode: [T, V] logits, log-softmax and exp kept; its layers are
    counted as the torch path's, an over-count); mode: the log-prob definition, "raw" or
    "processed" (the chunked head, unless materialized). checkpointing: train.activation_checkpointing.
    """
    if head not in HEADS or mode not in _CHUNK_BLOCKS:
        raise ValueError(f"activation_parts: head must be one of {HEADS} and mode 'raw' or 'processed', "
                         f"got {head!r}, {mode!r}")
    s = BYTES[dtype]
    C, D, L = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    padded = tokens if padded_tokens is None else max(tokens, padded_tokens)
    layers = [layer_saved(cfg, i, s, tokens, padded) for i in range(L)]
    once = tokens * (4 * _ID + 2 * s * D + _norm(C, s))
    if head == "fused":  # log-sum-exp and entropy
        once += 2 * _F32 * tokens
    elif head == "materialized":
        once += _MATERIALIZED_BLOCKS * tokens * cfg.vocab_size * _F32
    moe_grads = max((cfg.num_experts_per_tok * (3 * _F32 + 2 * s) * C for i in range(L) if cfg.is_moe_layer(i)),
                    default=0)
    layer_grads = max(layers) // 2 + (2 * s * C + moe_grads) * tokens
    if checkpointing:
        saved = once + L * s * C * tokens
        layer_peak = max(layers) + layer_grads
    else:
        saved = once + sum(layers)
        layer_peak = layer_grads
    lm = head_transient(cfg, tokens, s, head="chunked" if mode == "processed" and head == "fused" else head,
                        mode=mode, chunk_elems=chunk_elems)
    return Activations(saved=saved, transient=max(lm, layer_peak))


def activation_bytes(cfg: ModelConfig, tokens: int, dtype: str, **kw) -> int:
    """activation_parts(...).total: the learner's activation peak for one micro-batch (an upper bound)."""
    return activation_parts(cfg, tokens, dtype, **kw).total
