"""Per-device memory plan of a training run: what each part takes, and the KV pool from the rest.

    alpha * C_mem = M_weights      training state (analysis.memory): weights, fp32 masters, Adam
                                   moments, grads; + a PPO critic and a frozen KL reference. Under
                                   FSDP over K ranks all but the weights are sharded (1/K each); the
                                   weights count whole, as the engine decodes from them unsharded
                  + max(M_act,     the learner's activation peak for one micro-batch (estimated
                        M_sampler) here from the shapes, or measured in a dry run and passed in), or
                                   the engine's sampler workspace at its largest batch: training
                                   and generation take turns, so the larger of the two
                  + M_reserve      CUDA context, graph pools, workspaces, allocator slack; on the
                                   CPU the process itself (interpreter, torch, the extensions)
                  + KV pool        num_kv_blocks * bytes_per_block, shared by every engine on the
                                   device (rollout and eval: LLM(kv_pool=...)); on CUDA from the
                                   rest, on the CPU the trainer's own sizing, checked to fit
    B_KV = floor((alpha * C_mem - M_weights - M_runtime) / m_KV(S)),
    M_runtime = max(M_act, M_sampler) + M_reserve

which is docs/METHOD.md's B_KV (analysis.roofline.b_kv) with S = the engine's max_model_len. The plan
is built once per device before any engine exists (the engines are sized from it, not from the
free memory at construction time) and refuses, naming the numbers, a budget whose pool cannot
hold one GRPO group of G sequences at full length, or (a fixed pool) that the job overruns. The activation estimate (analysis/activations.py)
counts, tensor by tensor, what autograd saves in the learner's torch path and the backward's peak
on top (the LM head's workspace or one layer's gradients), for micro x S tokens: an upper bound.
On CUDA the trainer measures the peak of one learner micro-step instead and passes it as
`activations`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlengine.analysis.activations import BYTES as _BYTES
from rlengine.analysis.activations import activation_bytes
from rlengine.analysis.memory import training_state_bytes
from rlengine.analysis.roofline import b_kv, kv_bytes_per_seq, param_counts
from rlengine.model.config import ConfigError, ModelConfig

GiB = 2**30
__all__ = ["GiB", "MemoryPlan", "activation_bytes", "plan_memory"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPlan:
    """Bytes per part of one device's memory, and the KV pool they leave (see the module docstring)."""

    device_bytes: int          # C_mem (on the CPU: this rank's share of the host's available RAM)
    alpha: float               # usable fraction of C_mem
    weights: int               # compute-dtype weights (part of training_state)
    training_state: int        # M_weights: weights + masters + moments + grads (+ critic, KL reference)
    activations: int           # M_act: the learner's activation peak for one micro-batch
    activations_measured: bool  # False: activation_bytes() estimate
    sampler: int               # the engine's sampler workspace at its largest batch (never alongside M_act)
    reserve: int               # M_reserve: CUDA context, graphs, workspaces; on the CPU the process itself
    block_size: int            # P
    bytes_per_block: int       # 2 * L * P * Hkv * D * s_KV
    num_kv_blocks: int         # the pool: floor(kv budget / bytes_per_block), or the fixed CPU pool
    kv_fixed: bool             # True: the pool is sized by the job (the CPU trainer), not from what is left
    max_model_len: int         # S of m_KV(S)
    m_kv: int                  # kv_bytes_per_seq(S)
    b_kv: int                  # docs/METHOD.md's B_KV at S
    b_gen: int                 # sequences the rollout engine keeps in flight (its max_num_seqs)
    group_size: int            # G: sequences admitted together
    micro_batch: int = 0       # sequences per learner micro-batch the activations were counted for

    @property
    def runtime(self) -> int:
        """M_runtime: the learner and the sampler take turns (training, then generation), plus the reserve."""
        return max(self.activations, self.sampler) + self.reserve

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.bytes_per_block

    @property
    def free_bytes(self) -> int:
        """alpha x C_mem minus everything planned, the pool included (negative: over budget)."""
        return math.floor(self.alpha * self.device_bytes) - self.training_state - self.runtime - self.kv_bytes

    @property
    def group_blocks(self) -> int:
        """Blocks one group of G sequences needs at full length (no prompt sharing counted)."""
        return self.group_size * -(-self.max_model_len // self.block_size)

    @property
    def fits(self) -> bool:
        """Whether check() passes: a fixed pool fits the budget; a pool from the rest holds one group."""
        return self.free_bytes >= 0 if self.kv_fixed else self.num_kv_blocks >= self.group_blocks

    def _parts(self) -> str:
        return (f"alpha {self.alpha} x device {_gib(self.device_bytes)} - training state {_gib(self.training_state)} "
                f"- max(activations {_gib(self.activations)}, sampler {_gib(self.sampler)}) - reserve "
                f"{_gib(self.reserve)}")

    def check(self) -> "MemoryPlan":
        """Raise ConfigError, naming the numbers, if the plan does not fit (see fits)."""
        if self.kv_fixed and not self.fits:
            raise ConfigError(
                f"memory plan: the job needs {_gib(self.training_state + self.runtime + self.kv_bytes)} per rank but "
                f"has {_gib(self.alpha * self.device_bytes)}: {self._parts()} - KV pool {_gib(self.kv_bytes)} "
                f"({self.num_kv_blocks} blocks) is {_gib(self.free_bytes)}; shrink the model, train.micro_batch, "
                "gen.b_gen or gen.max_tokens, or run fewer ranks on this host")
        if not self.fits:
            raise ConfigError(
                f"memory plan: the KV pool gets {self.num_kv_blocks} blocks ({_gib(self.kv_bytes)}) but one group of "
                f"G={self.group_size} sequences of {self.max_model_len} tokens needs {self.group_blocks} "
                f"({_gib(self.group_blocks * self.bytes_per_block)}): {self._parts()} leaves too little; shrink the "
                "model, train.micro_batch or gen.max_tokens, or use a larger device")
        return self

    def lines(self) -> list[str]:
        """The plan as printed by `rlengine info --plan` and by the trainer."""
        act = "measured" if self.activations_measured else "estimated"
        micro = f"one learner micro-batch of {self.micro_batch} sequences" if self.micro_batch else \
            "one learner micro-batch"
        pool = "sized by the job" if self.kv_fixed else "from the rest"
        return [
            f"device memory C_mem        {_gib(self.device_bytes):>12}   usable alpha = {self.alpha}",
            f"weights (compute dtype)    {_gib(self.weights):>12}",
            f"training state M_weights   {_gib(self.training_state):>12}   weights + masters + moments + grads",
            f"activations ({act:9s})   {_gib(self.activations):>12}   {micro}",
            f"sampler workspace          {_gib(self.sampler):>12}   the engine's largest batch (not alongside "
            "the learner's activations)",
            f"runtime reserve            {_gib(self.reserve):>12}",
            f"KV pool                    {_gib(self.kv_bytes):>12}   {self.num_kv_blocks} blocks x "
            f"{self.bytes_per_block} B (P={self.block_size}), {pool}, shared by the rollout and eval engines",
            f"B_KV = floor((alpha*C_mem - M_weights - M_runtime) / m_KV(S)) = floor(({self.alpha} x "
            f"{_gib(self.device_bytes)} - {_gib(self.training_state)} - {_gib(self.runtime)}) / {_gib(self.m_kv)}) = "
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
                kl_reference: bool = False, head: str = "chunked", logprobs_mode: str = "raw",
                activations: int | None = None, activations_measured: bool | None = None, sampler: int = 0,
                reserve: int = GiB, alpha: float = 0.9, b_gen: int = 1, group_size: int = 1,
                fsdp_shards: int = 1, activation_checkpointing: bool = False, ref_offload: bool = False,
                num_kv_blocks: int | None = None, micro_batch: int = 0, lora_params: int = 0) -> MemoryPlan:
    """The plan for one device (bytes). activations: a measured peak (else activation_bytes() over
    micro_batch_tokens, with the learner's `head`, "chunked", "fused" or "materialized", and
    `logprobs_mode`; activations_measured: say which, default whether activations was given); sampler: the engine's sampler workspace (sampler_bytes); fsdp_shards: ranks the
    training state is sharded over (1: a full replica, as DDP keeps); activation_checkpointing /
    ref_offload: train.activation_checkpointing / train.ref_offload; num_kv_blocks: a pool the job
    sizes itself (the CPU trainer), checked against the budget, instead of the rest of it. lora_params:
    the LoRA adapters' stored elements (training_state_bytes), 0 = full fine-tuning."""
    if device_bytes <= 0 or max_model_len < 1 or micro_batch_tokens < 1 or block_size < 1:
        raise ConfigError(f"plan_memory needs device_bytes > 0, max_model_len, micro_batch_tokens and block_size "
                          f">= 1; got {device_bytes}, {max_model_len}, {micro_batch_tokens}, {block_size}")
    if not 0 < alpha <= 1:
        raise ConfigError(f"plan_memory: alpha must be in (0, 1], got {alpha}")
    s = _BYTES[dtype]
    weights = (param_counts(cfg).total + lora_params) * s
    state = training_state_bytes(cfg, dtype, master_weights, critic=critic, kl_reference=kl_reference,
                                 ref_offload=ref_offload, lora_params=lora_params)
    state = weights + -(-(state - weights) // max(1, fsdp_shards))
    measured = activations is not None if activations_measured is None else activations_measured
    if activations is None:
        activations = activation_bytes(cfg, micro_batch_tokens, dtype, checkpointing=activation_checkpointing,
                                       head=head, mode=logprobs_mode)
    per_block = 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * s
    runtime = max(activations, sampler) + reserve
    left = math.floor(alpha * device_bytes) - state - runtime
    m_kv = int(kv_bytes_per_seq(cfg, max_model_len, s))
    return MemoryPlan(
        device_bytes=device_bytes, alpha=alpha, weights=weights, training_state=state,
        activations=activations, activations_measured=measured, sampler=sampler, reserve=reserve,
        block_size=block_size, bytes_per_block=per_block,
        num_kv_blocks=max(0, left // per_block) if num_kv_blocks is None else num_kv_blocks,
        kv_fixed=num_kv_blocks is not None, max_model_len=max_model_len, m_kv=m_kv,
        b_kv=b_kv(alpha, device_bytes, state, runtime, m_kv), b_gen=b_gen, group_size=group_size,
        micro_batch=micro_batch)


SAMPLER_BLOCKS = {"plain": 3, "filtered": 11}  # [N, V] fp32 blocks at the sampler's peak (measured 2.1, 10.6)


def sampler_bytes(rows: int, vocab_size: int, dtype: str, *, filtered: bool) -> int:
    """The engine's sampling workspace for `rows` sequences: the [N, V] logits in the model dtype and
    the sampler's fp32 temporaries (top-k / top-p: the filter's passes, measured on the CPU with
    tests/support/cpu_peak.py at N 64, V 8192: 2.1 blocks plain, 10.6 with top_p)."""
    return rows * vocab_size * (_BYTES[dtype] + 4 * SAMPLER_BLOCKS["filtered" if filtered else "plain"])
