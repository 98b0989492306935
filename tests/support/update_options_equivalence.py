"""Run under torchrun (2 ranks, gloo): a learner step with several passes and the batch-wide options
equals one process's, in float64 (DDP and FSDP).

The options whose statistics span the whole batch: 2 PPO epochs (the second pass's ratios), token
rollout IS (its mean / max / capped fraction), the KL folded into GRPO scores and batch whitening
(global mean and std). Each rank holds whole groups (G = 2), as the trainer shards them; each also
builds the single-process reference itself. Writes {case: {metric: the worst rank's relative error}}.
Usage: torchrun --nproc-per-node 2 tests/support/update_options_equivalence.py OUT_JSON
"""

import sys

import torch

torch.set_num_threads(1)

from rlengine.model.config import preset  # noqa: E402
from rlengine.model.qwen3 import Qwen3ForCausalLM  # noqa: E402
from rlengine.rl.config import TrainSection  # noqa: E402
from rlengine.rl.distributed import init_from_env  # noqa: E402
from rlengine.rl.learner.learner import Learner  # noqa: E402
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from grad_equivalence import batch_of, params, rel, write_results  # noqa: E402

STATS = ("rollout_is_mean", "rollout_is_max", "rollout_is_capped_frac", "kl_reward", "loss", "clip_frac", "ratio_max")


def _shifted(batch):
    """batch_of's behaviour log-probs, 3 nats lower: around the tiny model's own (~ -log V), so the IS
    weights fall on both sides of the cap."""
    batch.old_logprobs = batch.old_logprobs - 3.0 * batch.loss_mask
    return batch


def case(dist, parallel):
    cfg = dict(prompts_per_step=4, group_size=2, lr=1e-3, micro_batch=1, max_grad_norm=1e9, ppo_epochs=2,
               rollout_is="token", rollout_is_cap=1.5, kl_in_reward=True, kl_reward_coef=0.2, adv_whiten="batch")
    mine = [0, 1, 2, 3] if dist.rank == 0 else [4, 5, 6, 7]
    learners = []
    for par, d in (("none", None), (parallel, dist)):
        model = Qwen3ForCausalLM(preset("tiny"), seed=0).to(torch.float64)
        learner = Learner(model, TrainSection(**cfg, parallel=par), dist=d)
        with torch.no_grad():  # a reference apart from the policy: the KL in the reward is not 0
            for p in learner.ref.parameters():
                p.mul_(1.03)
        learners.append((learner, model))
    (ref, ref_model), (learner, model) = learners
    m_ref = ref.step(_shifted(batch_of(range(8))))
    m = learner.step(_shifted(batch_of(mine)))
    errs = {k: abs(m[k] - m_ref[k]) / max(abs(m_ref[k]), 1e-30) for k in STATS}
    errs["params"] = max(rel(a, b) for a, b in zip(params(model), params(ref_model)))
    errs["moved"] = max(rel(a, b) for a, b in zip(params(ref_model), params(Qwen3ForCausalLM(preset("tiny"), seed=0)
                                                                             .to(torch.float64))))
    errs["capped"] = m_ref["rollout_is_capped_frac"]
    return errs


def main(out):
    dist = init_from_env()
    assert dist.world == 2, "run with torchrun --nproc-per-node 2"
    results = {}
    for parallel in ("ddp", "fsdp"):  # every rank's view, the worst kept: a rank-local statistic shows
        views = dist.all_gather_objects(case(dist, parallel))
        results[parallel] = {k: max(v[k] for v in views) if k != "moved" else min(v[k] for v in views)
                             for k in views[0]}
    write_results(dist, out, results)


if __name__ == "__main__":
    main(sys.argv[1])
