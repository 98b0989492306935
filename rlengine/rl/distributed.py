"""Several devices: the process group, the global reductions, and the DDP / FSDP2 wrapping.

torchrun starts one process per device (rlengine train --nproc K is a front to the same launcher);
each rank is the single-process engine + learner of the rest of rlengine, on its own device. This
module holds what the ranks share: `Dist` (rank, world size, device, the global reductions the
trainer and learner need, all no-ops in one process) and `parallelize` (DDP replicas, or FSDP2
`fully_shard` per decoder layer). Under FSDP the engine decodes from unsharded parameters inside
`Dist.unsharded(model)`: the rank all-gathers its layers for the rollout phase and reshards before
the update, so no second copy of the weights exists and none is copied to a generator. Checkpoints
of a sharded learner are written shard by shard (trainer/sharded.py), never gathered.
Several nodes run through torchrun's rendezvous (rlengine train --nnodes); the ranks form one flat
group. Simplifications: no inter-node topology; FSDP shards over all ranks (no HSDP).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rlengine.model.config import ConfigError


@dataclass(slots=True)
class Dist:
    """This process's place in the job. world == 1 means no process group (every method is local)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str = ""          # gloo | nccl ("" in one process)
    ckpt_group: object = None  # gloo group for checkpoint saves: its timeout is run.save_timeout_s

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    # ---- reductions (all ranks must call them, in the same order) -------------------------------
    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks of a list of floats (float64 on the wire)."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._wire_device())
        dist.all_reduce(t)
        return t.tolist()

    def all_max(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._wire_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def all_gather_objects(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] (picklable Python objects; small metadata only)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every rank (a small picklable object)."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def wait_for_save(self) -> None:
        """Return when every rank got here: the wait after a checkpoint save, on the checkpoint group,
        so a save that outlasts the training collectives' timeout does not fail the job."""
        if self.enabled:
            dist.barrier(group=self.ckpt_group)

    def close(self) -> None:
        """Leave the process group (every rank, at the end of a job: avoids teardown races in gloo)."""
        if self.enabled and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def _wire_device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")

    # ---- FSDP rollout phase ------------------------------------------------------------------
    @contextlib.contextmanager
    def unsharded(self, *modules: nn.Module):
        """Inside: every FSDP-sharded module among `modules` holds full parameters (the engine decodes
        from them); on exit they are resharded. A no-op for unsharded modules."""
        fsdp = [m for root in modules for m in _fsdp_modules(root)]
        for m in fsdp:
            m.unshard()
            m.set_reshard_after_forward(False)
        try:
            yield
        finally:
            for m in fsdp:
                m.reshard()
                m.set_reshard_after_forward(True)

    def check_same(self, what: str, payload: dict) -> None:
        """Raise on every rank when `payload` (e.g. the config) differs between ranks."""
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
        digests = self.all_gather_objects(digest)
        if len(set(digests)) > 1:
            bad = [r for r, d in enumerate(digests) if d != digests[0]]
            raise ConfigError(f"the {what} differs between ranks (rank 0 vs ranks {bad}): start every rank "
                              "with the same config and overrides")


def init_from_env(timeout_s: float = 300.0, save_timeout_s: float = 21600.0) -> Dist:
    """The Dist of this process: torchrun's RANK / WORLD_SIZE / LOCAL_RANK when present, else one process.

    This is the one place that reads the launcher's environment (the launch contract, not behaviour).
    Backend: nccl when CUDA is available, else gloo; each rank on cuda:LOCAL_RANK. Collectives time
    out after `timeout_s` with torch's error instead of hanging; checkpoint saves (their collectives
    and the wait for rank 0's writing) run on a gloo group of their own that waits `save_timeout_s`.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    ckpt_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=save_timeout_s))
    return Dist(rank=rank, world=world, local_rank=local, backend=backend, ckpt_group=ckpt_group)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: an FSDP DTensor is all-gathered (a collective: every rank calls it), others pass."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _fsdp_modules(root: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in root.modules() if isinstance(m, FSDPModule)]


def is_sharded(module: nn.Module) -> bool:
    return bool(_fsdp_modules(module))


def fsdp_shard(model: nn.Module, layers: list[nn.Module], warmup) -> nn.Module:
    """FSDP2: fully_shard each decoder layer, then the root (embedding, final norm, LM head).

    warmup(model) runs one tiny no-grad forward so FSDP initialises from the root (it refuses a
    child-first lazy init, which the engine's direct layer calls would cause); the root keeps its
    parameters unsharded after a forward, so everything is resharded explicitly afterwards: the
    optimizer must be built over the sharded parameters. Gradients are reduced in fp32 (float64 for
    a float64 model), never in bf16; the parameters keep their dtype, so the engine reads the
    learner's own storage.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = next(model.parameters()).dtype
    mp = MixedPrecisionPolicy(reduce_dtype=torch.promote_types(dtype, torch.float32))
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    with torch.no_grad():
        warmup(model)
    for m in _fsdp_modules(model):
        m.reshard()
    return model


def fp32_allreduce_hook(state, bucket):
    """DDP communication hook: reduce a low-precision gradient bucket in fp32 (never all-reduce bf16).

    The bucket is summed over ranks in fp32 and divided by the world size as DDP's default does; the
    result is written back in the bucket's dtype.
    """
    buf = bucket.buffer()
    world = dist.get_world_size()
    if buf.dtype in (torch.float32, torch.float64):  # already wide: never narrow a float64 test run
        fut = dist.all_reduce(buf.div_(world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    wide = buf.float().div_(world)
    fut = dist.all_reduce(wide, async_op=True).get_future()

    def back(f):
        buf.copy_(f.value()[0])
        return buf
    return fut.then(back)
