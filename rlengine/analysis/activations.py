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
                               its output s C and the fp32 copy index_add keeps (f C), 8 + s;
                               the fused Triton experts (kernels/fused_moe.py, moe= below) keep
                               per pair only the gate/up pre-activations (2 s F) and an int32 sort
                               entry: SwiGLU's output is recomputed in the backward, never stored
                               (Qwen3-30B-A3B, bf16: 24.6 KB a token against the torch path's 180 KB);
                               "fused_sorted" keeps them in expert-sorted order, plus up to
                               E (BLOCK_M - 1) padding rows a layer
  once per token               ids, positions, padding index and targets (4 x 8), cos / sin
                               (2 s D), the final norm and the head's input

The CPU learner runs RMSNorm, the q / k norm + RoPE and SiLU * up as autograd Functions over C++
kernels (model/train_ops.py, kernels=True below), which keep less: a norm its input and output (2 s n);
the q / k norm + RoPE only the qkv output (already counted) and its q, k, v outputs (s (H + 2 Hkv) D, in
place of the RoPE outputs and the q / k norms' tensors), plus one fp32 cos / sin table and positions per
forward (2 f D + 8, in place of cos / sin); where SiLU * up's Function runs too (AVX-512 builds, fp32 / bf16)
the MLP keeps gate_up's output and its result (3 s F).

Padded tokens: the learner pads the micro-batch's sequences to its longest (B x S_max rows) for
SDPA; the memory plan, which assumes every sequence at max_model_len, counts micro x S for both.
With train.activation_checkpointing every decoder layer keeps only its input (s C) and one layer's
saved tensors exist at a time, recomputed in the backward.

On top of `saved`, the backward's transient peak (`transient`), the larger of:
- the LM head's backward: grad_h (s C per token) and, chunked torch head (the CPU learner,
  learner/chunked_head.py): raw mode, when T fits one chunk, grad_W in the model's dtype (V C s)
  and 3.5 fp32 [T, V] blocks (the exp of the log-softmax block the forward saved, f V per token in
  `saved`; the logits' gradient and its 16-bit copy; and the forward's two blocks on top of what
  it leaves alive besides its saved tensors: measured up to 3.4 at V = 512 in an MoE model); over
  several chunks, or in processed mode, one chunk's fp32 grad_W, their fp32 sum, for a 16-bit
  model the fp32 head copy and the rounded grad_W (1 to 3 x V C f), and one
  [T_c, V] chunk's blocks (raw: 3.5, the recomputed log-softmax in place of the saved one; processed: 8,
  the logits with their autograd graph, the sort's values and int64 ids; measured alone 6.3);
  fused Triton head (CUDA, kernels/fused_logprob.py): grad_W (V C s), an fp32 vocab chunk of it (<= V C f), grad_h in
  fp32 (f C per token) and one d(logits) chunk; the batch-invariant head (model/batch_invariant.py),
  which keeps [T, V] fp32 logits, log-softmax and exp (3 T V f saved): their gradients, 3 T V f;
- one decoder layer's gradients: half its saved bytes (the engine frees each node's saved tensors
  as it runs, so a layer's gradients and its saved tensors are never all alive) plus the two
  residual gradients (2 s C), and in an MoE layer per routed pair the fp32 gradient of the
  expert's output, its rounded copy, the gathered input's gradient, index_add's source gradient
  and the forward's fp32 accumulator ((3 f + 2 s) C); checkpointed: the recomputed layer's saved
  tensors as well. Fused experts instead: "fused_v1" per pair dgu (2 s F), w * h (s F), dx (s C)
  and d router weight partials, then the top-k sum (s C a token); "fused_sorted" per pair dgu only,
  with dx accumulated token-major (f C + s C a token) and w * h recomputed inside the dW2 tiles:
  at Qwen3-30B-A3B in bf16, 38.4 KB a token against 75.3 KB (1.2 GB less at T = 32,768).

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
_CHUNK_BLOCKS = {"raw": 3.5, "processed": 8}  # [T_c, V] fp32-sized blocks alive in one chunk's backward
_MATERIALIZED_BLOCKS = 3  # [T, V] fp32 blocks the batch-invariant head keeps: logits, log-softmax, exp
HEADS = ("chunked", "fused", "materialized")
MOE_PATHS = ("torch", "fused_v1", "fused_sorted")  # the learner's experts: model/moe.py, kernels/fused_moe.py
MOE_BLOCK_M = 64  # the largest BLOCK_M of kernels/moe_gemm.py SHAPE_CLASSES: the sorted layout's padding unit


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


def moe_expert_bytes(cfg: ModelConfig, s: int, moe: str = "torch") -> tuple[int, int, int, int]:
    """One MoE layer's experts on path `moe` (MOE_PATHS): (saved, backward transient) per token, then
    the same two per layer (the sorted layout's padding rows: gu and an int32 id, then dgu)."""
    if moe not in MOE_PATHS:
        raise ValueError(f"moe must be one of {MOE_PATHS}, got {moe!r}")
    K, E, Fm, C = cfg.num_experts_per_tok, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if moe == "torch":
        return K * (2 * s * C + _F32 * C + 4 * s * Fm + _ID + s), K * (3 * _F32 + 2 * s) * C, 0, 0
    partials = _F32 * (Fm // 16 + 1)  # d router weight per F tile (BLOCK_N >= 16)
    saved = K * (2 * s * Fm + 4)
    if moe == "fused_v1":
        return saved, K * (3 * s * Fm + s * C + partials) + s * C, 0, 0
    pad = E * (MOE_BLOCK_M - 1)
    return saved, K * (2 * s * Fm + partials) + (_F32 + s) * C, pad * (2 * s * Fm + 4), pad * 2 * s * Fm


def layer_saved(cfg: ModelConfig, layer: int, s: int, tokens: int, padded_tokens: int, moe: str = "torch",
                kernels: bool = False, silu: bool = False) -> int:
    """Bytes one decoder layer's forward keeps for the backward (see the module docstring); kernels: the
    CPU kernels' Functions (model/train_ops.py) run the norms and q / k norm + RoPE, silu: SiLU * up too."""
    C, H, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    norm = 2 * s * C if kernels else _norm(C, s)
    if kernels:  # qkv, the Function's q, k, v outputs, the o_proj input
        per_tok = norm + s * (H + 2 * Hkv) * D + s * (H + 2 * Hkv) * D + s * H * D
    else:
        per_tok = norm + s * (H + 2 * Hkv) * D + s * (H + Hkv) * D + s * H * D
        if cfg.qk_norm:  # q_norm and k_norm: fp32 inputs (the qkv output itself in fp32), their normalised value
            per_tok += (0 if s >= _F32 else _F32 * (H + Hkv) * D) + _F32 * (H + Hkv) + s * (H + Hkv) * D
    per_tok += norm
    if cfg.is_moe_layer(layer):
        K, E = cfg.num_experts_per_tok, cfg.num_experts
        experts, _, per_layer, _ = moe_expert_bytes(cfg, s, moe)
        per_tok += _F32 * (E + K + 1) + 2 * _ID * K + experts
    else:
        per_tok += (3 if silu else 4) * s * cfg.intermediate_size
        per_layer = 0
    per_padded = s * (2 * H + 2 * Hkv) * D + _F32 * H
    return tokens * per_tok + padded_tokens * per_padded + per_layer


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
    # 16-bit model the fp32 head plus the rounded grad_W (half a copy) at the end; raw mode in one
    # chunk: grad_W alone, in the model's dtype
    if mode == "raw" and tokens <= rows:
        halves = 2 * s // _F32
    else:
        halves = (2 if s >= _F32 else 5) + (2 if tokens > rows else 0)
    return grad_h + halves * V * C * _F32 // 2 + int(_CHUNK_BLOCKS[mode] * rows * V * _F32)


def activation_parts(cfg: ModelConfig, tokens: int, dtype: str, *, padded_tokens: int | None = None,
                     checkpointing: bool = False, head: str = "chunked", mode: str = "raw",
                     chunk_elems: int = HEAD_CHUNK_ELEMS, moe: str = "torch",
                     kernels: bool | None = None) -> Activations:
    """Activation bytes of the learner's forward + backward over `tokens` packed tokens.

    padded_tokens: the rows the attention pads to (B x S_max; default tokens). head: "chunked" (the
    torch head, learner/chunked_head.py), "fused" (the Triton kernel, raw mode on CUDA) or
    "materialized" (batch-invariant mode: [T, V] logits, log-softmax and exp kept; its layers are
    counted as the torch path's, an over-count); mode: the log-prob definition, "raw" or
    "processed" (the chunked head, unless materialized). checkpointing: train.activation_checkpointing.
    moe: the experts' path (MOE_PATHS); "torch" bounds the fused ones too, so the plan uses it.
    kernels: the torch path's layers run the CPU kernels' Functions (model/train_ops.py); default: whether
    they are built here (the CPU learner's path; a CUDA plan passes False).
    """
    from rlengine.model import ext  # loads the extension: lazy, for the plan's light imports
    if kernels is None:
        kernels = ext.has_train_ops()
    silu = kernels and dtype != "float16" and ext.train_silu()  # train_ops.silu_and_mul's condition
    if head not in HEADS or mode not in _CHUNK_BLOCKS:
        raise ValueError(f"activation_parts: head must be one of {HEADS} and mode 'raw' or 'processed', "
                         f"got {head!r}, {mode!r}")
    s = BYTES[dtype]
    C, D, L = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    padded = tokens if padded_tokens is None else max(tokens, padded_tokens)
    layers = [layer_saved(cfg, i, s, tokens, padded, moe, kernels, silu) for i in range(L)]
    # ids, positions, padding index, targets; cos / sin (kernels: their fp32 table and positions), the final norm
    once = tokens * (4 * _ID + (2 * _F32 * D + _ID + 2 * s * C if kernels else 2 * s * D + _norm(C, s)))
    if head == "chunked" and mode == "raw" and tokens <= head_chunk_tokens(cfg.vocab_size, chunk_elems):
        once += tokens * cfg.vocab_size * _F32  # the one chunk's log-softmax block, saved for the backward
    if head == "fused":  # log-sum-exp and entropy
        once += 2 * _F32 * tokens
    elif head == "materialized":
        once += _MATERIALIZED_BLOCKS * tokens * cfg.vocab_size * _F32
    _, moe_grads, _, moe_pad = moe_expert_bytes(cfg, s, moe) if any(map(cfg.is_moe_layer, range(L))) else (0,) * 4
    layer_grads = max(layers) // 2 + (2 * s * C + moe_grads) * tokens + moe_pad
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
