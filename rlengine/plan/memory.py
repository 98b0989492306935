"""The memory plan of a job: analysis.memory_plan's pure arithmetic applied to a TrainConfig.

The job-level glue lives here, not in analysis/: reading the model's config (a preset, a
checkpoint directory or a hub id), the engines' max_model_len and batch from the task, the device's memory,
the default micro-batch, and the measured learner peak on CUDA. `rlengine info --plan`, the
launcher's `--nproc` check and the trainer's engine sizing all come through plan_for_config.

What each device is:
- CUDA: the device's total memory; the reserve is the CUDA context read off the device
  (total - free - what torch holds: other processes count too) plus CUDA_WORKSPACE_BYTES, and the
  KV pool is what the rest leaves.
- CPU: this rank's share of the host: (MemAvailable + this process's RSS) / ranks on the host, or
  the launcher's figure (RANK_MEMORY_ENV) for its ranks; the reserve is the process itself
  (CPU_PROCESS_BYTES), and the KV pool is the CPU trainer's own sizing (room for the larger engine
  batch at full length), checked to fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from rlengine.analysis.activations import activation_parts
from rlengine.analysis.memory_plan import GiB, MemoryPlan, plan_memory, sampler_bytes
from rlengine.model.config import ModelConfig
from rlengine.model.factory import model_config as factory_model_config
from rlengine.model.factory import tokenizer_for
from rlengine.rl.data.tasks import build_task

CPU_PROCESS_BYTES = 3 * GiB // 2      # interpreter, torch, the extensions, allocator slack (1-1.5 GB measured)
CUDA_CONTEXT_BYTES = GiB // 2         # the context where it cannot be read (a plan for a device not here)
CUDA_WORKSPACE_BYTES = GiB // 2       # cuBLAS / Triton / FlashInfer workspaces, decode graph pools
RANK_MEMORY_ENV = "RLENGINE_RANK_MEMORY"  # bytes per rank, set by the launcher for the ranks it starts


@dataclass(frozen=True, slots=True)
class JobShape:
    """What a job's engines are sized by: their max_model_len and the eval engine's batch."""

    max_model_len: int
    eval_seqs: int


def model_config(name: str, revision: str = "") -> ModelConfig:
    return factory_model_config(name, revision=revision or None)  # a preset, a directory or a hub id


def lora_params(cfg: ModelConfig, section) -> int:
    """The LoRA adapters' stored elements of a job's model section (model/lora.py), 0 without LoRA."""
    from rlengine.model.lora import check_lora_fits, lora_stored_count
    from rlengine.model.lora_peft import job_lora_spec

    spec = job_lora_spec(section)
    if spec is None:
        return 0
    check_lora_fits(cfg, spec)  # LoRA on MoE experts: refused before anything is built
    return lora_stored_count(cfg, spec)


def job_shape(tc) -> JobShape:
    """The engines' sizes for a TrainConfig, as the trainer makes them (builds the task and eval sets):
    max_model_len = the longest train / eval prompt + gen.max_tokens + 1, capped at the model's
    max_position_embeddings; eval_seqs = min(256, eval problems x eval.k)."""
    from rlengine.rl.rollout.evaluation import build_eval_sets

    t = tc.task
    task = build_task(t.name, path=t.path, eval_path=t.eval_path, reward=t.reward, num_train=t.num_train,
                      num_eval=t.num_eval, seed=t.seed)
    eval_problems = [p for es in build_eval_sets(task, tc.eval) for p in es.problems] if tc.eval.sets else task.eval
    encode = tokenizer_for(tc.model.name, revision=tc.model.revision, tokenizer=tc.model.tokenizer or None).encode
    return shape_of(tc, [len(encode(p.prompt)) for p in task.train + eval_problems], len(eval_problems),
                    model_config(tc.model.name, tc.model.revision).max_position_embeddings)


def shape_of(tc, prompt_lens: Sequence[int], eval_problems: int, max_positions: int) -> JobShape:
    """JobShape from the job's prompt lengths (train and eval, tokens): the longest + gen.max_tokens
    + 1 (the token sampled last), capped at max_positions; the eval batch for eval_problems."""
    return JobShape(min(max(prompt_lens) + tc.gen.max_tokens + 1, max_positions), eval_seqs_for(tc, eval_problems))


def eval_seqs_for(tc, eval_problems: int) -> int:
    """The eval engine's max_num_seqs: every eval problem's k samples at once, at most 256."""
    return min(256, (eval_problems if tc.eval.sets else tc.task.num_eval) * tc.eval.k)


def sequences_per_rank(tc, world_size: int = 1) -> int:
    """Sequences one rank trains on per optimizer step: its share of b_train / train.mini_batches."""
    mini = -(-tc.train.b_train // tc.train.mini_batches)
    return -(-mini // max(1, world_size))


def learner_head(tc, device_type: str) -> tuple[str, str]:
    """(head, mode) of the learner's log-prob path (rl/learner/logprobs.py) for activation_parts."""
    g = tc.gen
    mode = "processed" if g.logprobs_mode == "processed" and g.filtered else "raw"
    if g.batch_invariant:
        return "materialized", mode
    return ("fused" if device_type == "cuda" and mode == "raw" else "chunked"), mode


def plan_for_config(tc, *, device_bytes: int, max_model_len: int, eval_seqs: int = 0,
                    activations: int | None = None, reserve: int | None = None, alpha: float = 0.9,
                    device_type: str = "cuda", world_size: int = 1, micro_batch: int | None = None,
                    check: bool = True) -> MemoryPlan:
    """The plan of a TrainConfig's run (rlengine/rl/config) on one device (CUDA) or rank (CPU) of device_bytes.

    max_model_len / eval_seqs: the engines' (job_shape). activations: a measured peak (else the
    estimate for micro_batch sequences of max_model_len, default train.micro_batch or the rank's
    whole share; PPO adds the critic's saved tensors, estimated). reserve: default the module docstring's. world_size: ranks of the run
    (train.parallel = fsdp shards the training state over them). check: raise if it does not fit.
    """
    cfg = model_config(tc.model.name, tc.model.revision)
    t, g = tc.train, tc.gen
    most = sequences_per_rank(tc, world_size)
    micro = micro_batch or (min(t.micro_batch, most) if t.micro_batch else most)
    head, mode = learner_head(tc, device_type)
    measured = activations is not None
    act = activation_parts(cfg, micro * max_model_len, tc.model.dtype, checkpointing=t.activation_checkpointing,
                           head=head, mode=mode, kernels=None if device_type == "cpu" else False)
    activations = act.total if activations is None else activations
    critic = t.algorithm.critic
    if critic:  # the critic trunk's saved tensors (<= the actor's) live through the actor's backward
        activations += act.saved
    if reserve is None:
        reserve = CUDA_CONTEXT_BYTES + CUDA_WORKSPACE_BYTES if device_type == "cuda" else CPU_PROCESS_BYTES
    kv_blocks = g.num_kv_blocks or None
    if kv_blocks is None and device_type != "cuda":  # the CPU trainer's pool: the larger engine at full length
        kv_blocks = max(tc.b_gen, eval_seqs) * -(-max_model_len // g.block_size)
    plan = plan_memory(
        cfg, device_bytes=device_bytes, dtype=tc.model.dtype, max_model_len=max_model_len,
        micro_batch_tokens=micro * max_model_len, block_size=g.block_size, master_weights=t.master_weights,
        critic=critic, kl_reference=t.kl_coef > 0 or t.kl_in_reward, ref_offload=t.ref_offload,
        activation_checkpointing=t.activation_checkpointing, head=head, logprobs_mode=mode,
        activations=activations, activations_measured=measured, sampler=sampler_bytes(max(tc.b_gen, eval_seqs), cfg.vocab_size, tc.model.dtype,
                                                       filtered=g.filtered),
        reserve=reserve, alpha=alpha, b_gen=tc.b_gen, group_size=t.group_size,
        fsdp_shards=world_size if t.parallel == "fsdp" else 1, num_kv_blocks=kv_blocks, micro_batch=micro,
        lora_params=lora_params(cfg, tc.model))
    return plan.check() if check else plan


def choose_micro_batch(make_plan: Callable[[int], MemoryPlan], most: int) -> tuple[int, MemoryPlan]:
    """The largest micro-batch in [1, most] sequences whose plan fits, and that plan. A pool from the
    rest (CUDA) must also keep B_KV >= B_gen when any micro-batch does, so the learner's memory never
    turns the rollout into preemptions; a micro-batch of 1 that does not fit is returned unchecked."""
    def good(plan: MemoryPlan, strict: bool) -> bool:
        return plan.fits and (not strict or plan.kv_fixed or plan.b_kv >= plan.b_gen)

    for strict in (True, False):
        lo, hi, best = 1, most, None
        while lo <= hi:  # activations grow with the micro-batch: the first failure bounds the search
            mid = (lo + hi) // 2
            plan = make_plan(mid)
            if good(plan, strict):
                best, lo = (mid, plan), mid + 1
            else:
                hi = mid - 1
        if best is not None:
            return best
    return 1, make_plan(1)


def host_memory_per_rank(local_ranks: int | None = None, *, own: bool = True) -> tuple[int, str]:
    """(bytes, where from) of one CPU rank's share of this host (see the module docstring); local_ranks
    defaults to torchrun's LOCAL_WORLD_SIZE (1 outside a launched job). own: count this process's RSS
    as available (it is the job's own process; not for a launcher planning the ranks it starts)."""
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if own and os.environ.get(RANK_MEMORY_ENV):
        return int(os.environ[RANK_MEMORY_ENV]), f"the launcher's share of this host's RAM ({RANK_MEMORY_ENV})"
    avail = _meminfo("MemAvailable") + (_own_rss() if own else 0)
    share = f" / {local_ranks} ranks" if local_ranks > 1 else ""
    return avail // max(1, local_ranks), "this host's available RAM" + (" + this process's RSS" if own else "") + share


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # no /proc: physical RAM


def _own_rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def device_memory() -> tuple[int, str]:
    """(bytes, where from) of this machine's device: CUDA total memory, else this process's share of RAM."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, f"CUDA device 0 ({torch.cuda.get_device_name(0)})"
    return host_memory_per_rank()


def cuda_context_bytes(device: torch.device) -> int:
    """Device memory this process's torch allocator does not hold: the CUDA context, the libraries'
    handles and any other process on the device (total - free - reserved by torch)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def plan_job(tc, shape: JobShape, *, device_bytes: int, device_type: str, world_size: int = 1,
             reserve: int | None = None, measure: Callable[[int], int] | None = None,
             micro_batch: int | None = None) -> MemoryPlan:
    """plan_for_config with the micro-batch resolved (checked): micro_batch, else train.micro_batch,
    else (0) the largest the plan fits (choose_micro_batch: plan.micro_batch says which).
    measure(micro) -> the learner's measured peak at that micro-batch (CUDA: learner_peak), taken at
    the chosen micro-batch and planned with instead of the estimate."""
    kw = dict(device_bytes=device_bytes, max_model_len=shape.max_model_len, eval_seqs=shape.eval_seqs,
              device_type=device_type, world_size=world_size, reserve=reserve)
    most = sequences_per_rank(tc, world_size)
    micro = micro_batch or min(tc.train.micro_batch, most)
    if not micro:
        micro, _ = choose_micro_batch(lambda m: plan_for_config(tc, micro_batch=m, check=False, **kw), most)
    return plan_for_config(tc, micro_batch=micro, activations=measure(micro) if measure else None, **kw)


class CudaPeak:
    """with CudaPeak(device) as meter: ...; meter.peak = the most bytes torch allocated above the entry level."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
        return False


def learner_peak(model, tc, sequences: int, seq_len: int, meter) -> int:
    """The activation peak of one learner micro-step: forward and backward of the policy's log-probs
    and entropy over `sequences` random sequences of seq_len tokens, through the learner's head, mode
    and checkpointing (rl/learner/logprobs.py). Parameter gradients are allocated first (they are
    training state, and a later micro-batch accumulates into them) and restored after. The step runs
    twice and only the second is metered: the first makes the one-time allocations that are no
    activations (on an H200 a tiny model's first step peaked at 38 MB against a 21 MB estimate, about
    cuBLAS's 32 MiB default workspace too much; the plan's CUDA reserve counts workspaces). meter: a
    context manager whose .peak is bytes above its entry level (CudaPeak; on the CPU
    tests/support/cpu_peak.PeakHeap stands in)."""
    from rlengine.rl.learner.batching import TrainBatch
    from rlengine.rl.learner.logprobs import processed_token_logprobs, token_logprobs

    device, g = model.device, tc.gen
    mb = TrainBatch.random_tokens(model.config.vocab_size, sequences, seq_len, device)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    for p in params:  # fresh zeros: the originals come back untouched
        p.grad = torch.zeros_like(p)
    temperature, ckpt = g.temperature if g.temperature > 0 else 1.0, tc.train.activation_checkpointing
    processed = learner_head(tc, device.type)[1] == "processed"

    def micro_step():
        if processed:
            logp, ent = processed_token_logprobs(model, mb, temperature, g.top_k, g.top_p, ckpt)
        else:
            logp, ent = token_logprobs(model, mb, temperature, device.type == "cuda", ckpt)
        (logp.sum() + ent.sum()).backward()

    try:
        micro_step()
        with meter:
            micro_step()
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
    return meter.peak
