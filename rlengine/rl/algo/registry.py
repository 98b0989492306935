"""The algorithm registry: advantage estimators, policy losses, and the algorithms that pair them.

An algorithm is a registry entry, not a branch: its advantage estimator (group-relative on outcome
rewards, or from a learned value with GAE), its policy loss, whether it trains a critic, and the
options only it accepts. The trainer, learner, memory plan and config validation ask the entry
(`algorithm(name).critic`, `.group_relative`, `.estimator.fn`, `.loss.fn`) and never compare the
algorithm's name. Adding an objective is one function and one registry line, as in verl's
core_algos:

    @register_estimator("rloo")
    def rloo(rewards_PG, opts): ...                   # [P, G] rewards -> [P, G] advantages
    register_algorithm(Algorithm(name="rloo", estimator="rloo", default_group_size=8))

Signatures. An outcome estimator (critic=False) maps [P, G] fp32 rewards and the update options
(LearnerSpec.options: train.* as the user wrote them) to [P, G] advantages; its optional token_fn
maps one group's per-token credits to per-token advantages (train.credit = "token"). A critic
estimator's fn is GAE-shaped (rewards_BT, values_BT, mask_BT, *, gamma, lam) and runs in the
learner, which owns the values. A policy loss has losses.policy_loss's signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rlengine.model.config import ConfigError
from rlengine.rl.algo.advantages import gae, grpo_advantages, grpo_token_advantages
from rlengine.rl.algo.losses import policy_loss


@dataclass(frozen=True, slots=True)
class Estimator:
    """An advantage estimator."""

    name: str
    fn: Callable                    # outcome: fn(rewards_PG, opts) -> [P, G]; critic: GAE-shaped (docstring)
    critic: bool                    # advantages from a learned value (the learner runs fn with its critic)
    group_relative: bool            # compares a prompt's G responses: G >= 2, dynamic sampling applies
    token_fn: Callable | None = None  # per-token credit: fn(credits_G, opts) -> [G][len]; None: sequence only


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """A policy loss (losses.policy_loss's signature)."""

    name: str
    fn: Callable


@dataclass(frozen=True, slots=True, kw_only=True)
class Algorithm:
    """A named pairing of an estimator and a policy loss (train.algo)."""

    name: str
    estimator_name: str
    loss_name: str = "vanilla"
    default_group_size: int         # G when train.group_size = 0
    options: tuple[str, ...] = ()   # train.* options only this algorithm accepts (checked by the config)
    summary: str = ""               # one line for `rlengine config show`

    @property
    def estimator(self) -> Estimator:
        return ESTIMATORS[self.estimator_name]

    @property
    def loss(self) -> PolicyLoss:
        return POLICY_LOSSES[self.loss_name]

    @property
    def critic(self) -> bool:
        return self.estimator.critic

    @property
    def group_relative(self) -> bool:
        return self.estimator.group_relative


ESTIMATORS: dict[str, Estimator] = {}
POLICY_LOSSES: dict[str, PolicyLoss] = {}
ALGORITHMS: dict[str, Algorithm] = {}


def register_estimator(name: str, *, critic: bool = False, group_relative: bool = True,
                       token_fn: Callable | None = None):
    """Decorator: register fn as the advantage estimator `name`."""
    def add(fn):
        ESTIMATORS[name] = Estimator(name, fn, critic, group_relative and not critic, token_fn)
        return fn
    return add


def register_policy_loss(name: str):
    """Decorator: register fn as the policy loss `name`."""
    def add(fn):
        POLICY_LOSSES[name] = PolicyLoss(name, fn)
        return fn
    return add


def register_algorithm(algo: Algorithm) -> Algorithm:
    """Add (or replace) an algorithm; its estimator and loss must be registered already."""
    for kind, key, table in (("estimator", algo.estimator_name, ESTIMATORS), ("policy loss", algo.loss_name,
                                                                            POLICY_LOSSES)):
        if key not in table:
            raise ValueError(f"algorithm {algo.name!r}: unknown {kind} {key!r}; registered: {', '.join(table)}")
    ALGORITHMS[algo.name] = algo
    return algo


def algorithm(name: str) -> Algorithm:
    """The registered algorithm `name`; ConfigError naming train.algo and the known ones otherwise."""
    if name not in ALGORITHMS:
        raise ConfigError(f"train.algo must be one of {'|'.join(ALGORITHMS)}, got {name!r}")
    return ALGORITHMS[name]


# ---- the built-in entries ------------------------------------------------------------------------

def _grpo_tokens(credits_G, opts):
    return grpo_token_advantages(credits_G, normalize_std=opts.normalize_std)


@register_estimator("grpo", token_fn=_grpo_tokens)
def _grpo(rewards_PG, opts):
    """Group-relative: (r - mean_G) / (std_G + eps), or centred only with train.normalize_std = false."""
    return grpo_advantages(rewards_PG, normalize_std=opts.normalize_std)


register_estimator("gae", critic=True)(gae)
register_policy_loss("vanilla")(policy_loss)

register_algorithm(Algorithm(name="grpo", estimator_name="grpo", default_group_size=8,
                             options=("credit", "adv_whiten"),
                             summary="group-relative advantages (grpo) + clipped surrogate (vanilla), no critic"))
register_algorithm(Algorithm(name="ppo", estimator_name="gae", default_group_size=1,
                             options=("critic_lr_mult", "critic_warmup"),
                             summary="GAE advantages from a critic (gae) + clipped surrogate (vanilla)"))
