"""The plan of one rank's job: the config, this device and the model in, a JobPlan out.

The trainer calls plan_job once, after the model is built and the prompts are known (their lengths
size max_model_len): the memory plan of this device (plan/memory.py) with the learner's
micro-batch resolved (train.micro_batch = 0: the largest the plan fits, picked by rank 0 for every
rank; on CUDA the learner's peak is measured at it), the rollout and eval engines' specs, the
rollout spec and the learner spec. Nothing is written back into the config: what was resolved is
in the plan, printed at the start of a run and kept as RUN_DIR/plan.json.
"""

from __future__ import annotations

import torch

from rlengine.plan.memory import (CUDA_WORKSPACE_BYTES, CudaPeak, JobShape, cuda_context_bytes, host_memory_per_rank,
                                  learner_peak, plan_job as plan_memory_of_job, sequences_per_rank)
from rlengine.plan.specs import EngineSpec, JobPlan, resolve_learner, resolve_rollout
from rlengine.rl.config import TrainConfig
from rlengine.rl.distributed import Dist


def plan_job(cfg: TrainConfig, model, shape: JobShape, dist: Dist, *, moe_impl: str,
             pinned_micro_batch: int | None = None) -> JobPlan:
    """The job's plan on this rank's device for `model` (built) and `shape` (its engines' sizes).
    pinned_micro_batch: the micro-batch a resumed run's plan.json recorded (train.micro_batch = 0), so
    the run goes on with the micro-batches it started with, whatever this machine's plan would pick."""
    memory, micro = plan_device_memory(cfg, model, shape, dist, pinned_micro_batch)
    g = cfg.gen
    common = dict(block_size=g.block_size, max_model_len=shape.max_model_len, attention_backend=cfg.attention_backend,
                  enforce_eager=g.enforce_eager, cpu_kernels=g.cpu_kernels, batch_invariant=g.batch_invariant,
                  shared_prefix_decode=None if g.shared_prefix_decode == "auto" else g.shared_prefix_decode,
                  moe_impl=moe_impl, decode_kernels=g.decode_kernels)
    rollout = resolve_rollout(cfg)
    engine = EngineSpec(max_num_seqs=rollout.b_gen, num_kv_blocks=memory.num_kv_blocks, seed=cfg.run.seed,
                        record_routing=g.record_routing, **common)
    # the eval engine shares the rollout engine's KV pool: one cache per device, never a second one
    eval_engine = EngineSpec(max_num_seqs=shape.eval_seqs, num_kv_blocks=None, seed=cfg.run.seed + 1,
                             record_routing=False, **common)
    return JobPlan(run_dir=cfg.run_dir, rollout=rollout, engine=engine, eval_engine=eval_engine,
                   learner=resolve_learner(cfg, micro), memory=memory)


def plan_device_memory(cfg: TrainConfig, model, shape: JobShape, dist: Dist, pinned: int | None = None):
    """(memory plan, learner micro-batch) of this device, checked. With train.micro_batch = 0 rank 0
    picks the largest micro-batch the plan fits and every rank trains with it (0 when that is the
    rank's whole share); on CUDA the learner's peak is measured at that micro-batch."""
    t, cuda = cfg.train, model.device.type == "cuda"
    if cuda:
        kw = dict(device_bytes=torch.cuda.get_device_properties(model.device).total_memory, device_type="cuda",
                  reserve=cuda_context_bytes(model.device) + CUDA_WORKSPACE_BYTES)
    else:
        kw = dict(device_bytes=host_memory_per_rank()[0], device_type="cpu")
    kw["world_size"] = dist.world
    most = sequences_per_rank(cfg, dist.world)
    micro = None  # one process: plan_memory_of_job picks it below
    if not t.micro_batch and pinned is not None:
        micro = pinned or most
    elif not t.micro_batch and dist.enabled:  # one choice for every rank (their budgets may differ by a little)
        plan = plan_memory_of_job(cfg, shape, **kw) if dist.rank == 0 else None
        micro = dist.broadcast_object(plan.micro_batch if plan is not None else None)
    measure = (lambda m: learner_peak(model, cfg, m, shape.max_model_len, CudaPeak(model.device))) if cuda else None
    plan = plan_memory_of_job(cfg, shape, measure=measure, micro_batch=micro, **kw)
    chosen = t.micro_batch
    if not t.micro_batch and plan.micro_batch < most:
        chosen = plan.micro_batch
        if dist.is_main:
            print(f"train.micro_batch = 0: micro-batches of {plan.micro_batch} sequences (of {most} per rank), "
                  "the largest the memory plan fits", flush=True)
    if cuda and dist.is_main:
        print(f"memory plan: activations: measured {plan.activations / 2**30:.2f} GiB at {plan.micro_batch} x "
              f"{shape.max_model_len} tokens; KV pool {plan.num_kv_blocks} blocks, B_KV {plan.b_kv}", flush=True)
    return plan, chosen
