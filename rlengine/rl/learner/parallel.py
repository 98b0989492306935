"""The learner's parallel wrapper: DDP or FSDP2 over the policy, the critic and the KL reference.

One process: the modules as they are. Several ranks: every replica starts from rank 0's weights
(the warm start ran on each), then either DDP (the engine decodes from the replica it trains;
gradients all-reduced in fp32 by a comm hook; unused experts allowed on MoE) or FSDP2 (the policy,
the reference and the critic trunk sharded per decoder layer; the rank unshards for the rollout).
With master weights the learner reduces every micro-batch; without, no_sync() defers the all-reduce
to the last micro-batch of an update.
"""

from __future__ import annotations

import contextlib

import torch

from rlengine.rl.distributed import Dist


def parallel_mode(option: str, dist: Dist) -> str:
    """train.parallel resolved: auto = ddp with several ranks, none with one."""
    return option if option != "auto" else ("ddp" if dist.enabled else "none")


def parallelize(mode: str, dist: Dist, model, critic, ref):
    """Wrap for `mode`; returns the modules the learner calls (actor, critic or None)."""
    if mode == "none" or not dist.enabled:
        return model, critic
    from torch.nn.parallel import DistributedDataParallel as DDP

    from rlengine.rl.distributed import fp32_allreduce_hook, fsdp_shard

    for m in (model, critic, ref):  # identical replicas to start from (warm start)
        if m is not None:
            for t in m.state_dict().values():
                torch.distributed.broadcast(t, 0)
    if mode == "ddp":
        ids = None if model.device.type == "cpu" else [model.device.index]
        # MoE: experts no token was routed to get no gradient in a step
        actor = DDP(model, device_ids=ids, forward_sync_buffers=False, find_unused_parameters=model.config.is_moe)
        actor.register_comm_hook(None, fp32_allreduce_hook)
        critic_fwd = None
        if critic is not None:
            critic_fwd = DDP(critic, device_ids=ids, forward_sync_buffers=False)
            critic_fwd.register_comm_hook(None, fp32_allreduce_hook)
        return actor, critic_fwd
    # fsdp: the policy, the reference and the critic trunk are sharded per decoder layer
    one = torch.zeros(1, dtype=torch.long, device=model.device)
    for m in (model, ref):  # LoRA's reference (a BaseView: the policy, adapters off) has no weights of its own
        if m is not None and next(m.parameters(), None) is not None:
            fsdp_shard(m, list(m.model.layers), lambda mod: mod(one[None]))
    if critic is not None:
        fsdp_shard(critic, list(critic.trunk.layers), lambda mod: mod(one, [0, 1]))
    return model, critic


def no_sync(mode: str, dist: Dist, modules, *, last: bool, masters: bool):
    """DDP without master weights: gradients accumulate locally and are reduced once, at the last
    micro-batch. With masters every micro-batch is reduced (in fp32) before it moves into them."""
    if last or mode != "ddp" or masters or not dist.enabled:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for m in modules:
        if m is not None:
            stack.enter_context(m.no_sync())
    return stack
