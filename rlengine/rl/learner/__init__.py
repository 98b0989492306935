"""Learning from rollouts: scored groups packed into a TrainBatch (batching.py) and one optimizer
update per batch (learner.py: micro-batches, the policy loss, KL reference, critic, DDP / FSDP)."""

from rlengine.rl.learner.batching import TrainBatch
from rlengine.rl.learner.learner import Learner

__all__ = ["Learner", "TrainBatch"]
