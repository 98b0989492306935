"""Per-device memory plan of a training run: what each part takes, and the KV pool from the rest.

    alpha * C_mem = M_weights      training state (analysis.memory): weights, fp32 masters, Adam
                                   moments, grads; + a PPO critic and a frozen KL reference. Under
                                   FSDP over K ranks all but the weights are sharded (1/K each); the
                                   weights count whole, as the engine decodes from them unsharded
                  + M_act          the learner's activation peak for one micro-batch (estimated
                                   here from the shapes, or measured in a dry run and passed in)
                  + M_reserve      CUDA context, graph pools, workspaces, allocator slack
                  + KV pool        num_kv_blocks * bytes_per_block, shared by every engine on the
                                   device (rollout and eval: LLM(kv_pool=...))
    B_KV = floor((alpha * C_mem - M_weights - M_runtime) / m_KV(S)),  M_runtime = M_act + M_reserve

which is docs/METHOD.md's B_KV (analysis.roofline.b_kv) with S = the engine's max_model_len. The plan
is built once per device before any engine exists (the engines are sized from it, not from the
free memory at construction time) and refuses, naming the numbers, a budget whose pool cannot
hold one GRPO group of G sequences at full length. Simplification: the activation estimate counts
what autograd saves per token in the torch training path (with train.activation_checkpointing: each
layer's input, plus one layer recomputed at a time) plus, in the processed
log-prob mode, the [T, V] fp32 logits; it errs high rather than low. For a tight plan, measure:
torch.cuda.max_memory_allocated() around one learner micro-step, passed as `activations`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlengine.analysis.memory import training_state_bytes
from rlengine.analysis.roofline import b_kv, kv_bytes_per_seq, param_counts
from rlengine.config import ConfigError, ModelConfig

_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
GiB = 2**30


def activation_bytes(cfg: ModelConfig, tokens: int, dtype: str, *, materialized_logits: bool = False,
                     checkpointing: bool = False) -> int:
    """Estimated activation peak of the learner's forward + backward over `tokens` packed tokens.

    Per layer and token, in the compute dtype: the saved inputs of the two RMSNorms and the
    projections (4C), q / k before and after norm + RoPE, v and the attention output (4 (H + Hkv) D),
    and the MLP's gate / up / activation (3F; an MoE layer: K experts' 3 F_moe, the K gathered inputs
    K C and the router's E fp32 probabilities). One more layer's worth for the backward's transient
    gradients, the embeddings and final norm (3C). materialized_logits: the processed log-prob mode
    sorts [T, V] fp32 logits (logits, log-softmax and their gradient: 3 V fp32 per token); the fused
    raw mode keeps no [T, V] tensor. checkpointing (each decoder layer recomputed in the backward):
    every layer keeps only its input (C), and one layer's saved tensors exist at a time, so the
    per-layer sum becomes L C + max(per layer) (the transient gradients' layer as before).
    """
    s = _BYTES[dtype]
    C, H, Hkv, D, L = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                       cfg.num_hidden_layers)
    attn = 4 * C + 4 * (H + Hkv) * D
    per_layer = []
    for layer in range(L):
        if cfg.is_moe_layer(layer):
            K = cfg.num_experts_per_tok
            mlp = K * (3 * cfg.moe_intermediate_size + C) + cfg.num_experts * 4 // s
        else:
            mlp = 3 * cfg.intermediate_size
        per_layer.append(attn + mlp)
    saved = L * C + max(per_layer) if checkpointing else sum(per_layer)
    elems = saved + max(per_layer) + 3 * C
    total = tokens * elems * s
    if materialized_logits:
        total += tokens * cfg.vocab_size * 4 * 3
    return total


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPlan:
    """Bytes per part of one device's memory, and the KV pool they leave (see the module docstring)."""

    device_bytes: int          # C_mem
    alpha: float               # usable fraction of C_mem
    weights: int               # compute-dtype weights (part of training_state)
    training_state: int        # M_weights: weights + masters + moments + grads (+ critic, KL reference)
    activations: int           # M_act: the learner's activation peak for one micro-batch
    activations_measured: bool  # False: activation_bytes() estimate
    reserve: int               # M_reserve: context, graphs, workspaces
    block_size: int            # P
    bytes_per_block: int       # 2 * L * P * Hkv * D * s_KV
    num_kv_blocks: int         # the pool: floor(kv budget / bytes_per_block)
    max_model_len: int         # S of m_KV(S)
    m_kv: int                  # kv_bytes_per_seq(S)
    b_kv: int                  # docs/METHOD.md's B_KV at S
    b_gen: int                 # sequences the rollout engine keeps in flight (its max_num_seqs)
    group_size: int            # G: sequences admitted together

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.bytes_per_block

    @property
    def group_blocks(self) -> int:
        """Blocks one group of G sequences needs at full length (no prompt sharing counted)."""
        return self.group_size * -(-self.max_model_len // self.block_size)

    def check(self) -> "MemoryPlan":
        """Raise ConfigError, naming the numbers, if the pool cannot hold one group at full length."""
        if self.num_kv_blocks < self.group_blocks:
            raise ConfigError(
                f"memory plan: the KV pool gets {self.num_kv_blocks} blocks ({_gib(self.kv_bytes)}) but one group of "
                f"G={self.group_size} sequences of {self.max_model_len} tokens needs {self.group_blocks} "
                f"({_gib(self.group_blocks * self.bytes_per_block)}): alpha {self.alpha} x device "
                f"{_gib(self.device_bytes)} - training state {_gib(self.training_state)} - activations "
                f"{_gib(self.activations)} - reserve {_gib(self.reserve)} leaves too little; shrink the model, train.micro_batch or gen.max_tokens, "
                "or use a larger device")
        return self

    def lines(self) -> list[str]:
        """The plan as printed by `rlengine info --plan`."""
        act = "measured" if self.activations_measured else "estimated"
        runtime = self.activations + self.reserve
        return [
            f"device memory C_mem        {_gib(self.device_bytes):>12}   usable alpha = {self.alpha}",
            f"weights (compute dtype)    {_gib(self.weights):>12}",
            f"training state M_weights   {_gib(self.training_state):>12}   weights + masters + moments + grads",
            f"activations ({act:9s})   {_gib(self.activations):>12}   one learner micro-batch",
            f"runtime reserve            {_gib(self.reserve):>12}",
            f"KV pool                    {_gib(self.kv_bytes):>12}   {self.num_kv_blocks} blocks x "
            f"{self.bytes_per_block} B (P={self.block_size}), shared by the rollout and eval engines",
            f"B_KV = floor((alpha*C_mem - M_weights - M_runtime) / m_KV(S)) = floor(({self.alpha} x "
            f"{_gib(self.device_bytes)} - {_gib(self.training_state)} - {_gib(runtime)}) / {_gib(self.m_kv)}) = "
            f"{self.b_kv} sequences of S={self.max_model_len}",
            f"rollout B_gen = {self.b_gen}: " + ("fits (no preemption at full length)" if self.b_kv >= self.b_gen
                                                 else "exceeds B_KV: expect recompute preemptions"),
        ]


def _gib(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (GiB, MiB, KiB, B)."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def plan_memory(cfg: ModelConfig, *, device_bytes: int, dtype: str, max_model_len: int, micro_batch_tokens: int,
                block_size: int = 16, master_weights: str = "auto", critic: bool = False,
                kl_reference: bool = False, materialized_logits: bool = False, activations: int | None = None,
                reserve: int = GiB, alpha: float = 0.9, b_gen: int = 1, group_size: int = 1,
                fsdp_shards: int = 1, activation_checkpointing: bool = False, ref_offload: bool = False
                ) -> MemoryPlan:
    """The plan for one device (bytes). activations: a measured peak (else activation_bytes());
    fsdp_shards: ranks the training state is sharded over (1: a full replica, as DDP keeps);
    activation_checkpointing / ref_offload: train.activation_checkpointing / train.ref_offload."""
    if device_bytes <= 0 or max_model_len < 1 or micro_batch_tokens < 1 or block_size < 1:
        raise ConfigError(f"plan_memory needs device_bytes > 0, max_model_len, micro_batch_tokens and block_size "
                          f">= 1; got {device_bytes}, {max_model_len}, {micro_batch_tokens}, {block_size}")
    if not 0 < alpha <= 1:
        raise ConfigError(f"plan_memory: alpha must be in (0, 1], got {alpha}")
    s = _BYTES[dtype]
    weights = param_counts(cfg).total * s
    state = training_state_bytes(cfg, dtype, master_weights, critic=critic, kl_reference=kl_reference,
                                 ref_offload=ref_offload)
    state = weights + -(-(state - weights) // max(1, fsdp_shards))
    measured = activations is not None
    if activations is None:
        activations = activation_bytes(cfg, micro_batch_tokens, dtype, materialized_logits=materialized_logits,
                                       checkpointing=activation_checkpointing)
    per_block = 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * s
    left = math.floor(alpha * device_bytes) - state - activations - reserve
    m_kv = int(kv_bytes_per_seq(cfg, max_model_len, s))
    return MemoryPlan(
        device_bytes=device_bytes, alpha=alpha, weights=weights, training_state=state,
        activations=activations, activations_measured=measured, reserve=reserve, block_size=block_size,
        bytes_per_block=per_block, num_kv_blocks=max(0, left // per_block), max_model_len=max_model_len,
        m_kv=m_kv, b_kv=b_kv(alpha, device_bytes, state, activations + reserve, m_kv), b_gen=b_gen,
        group_size=group_size)
