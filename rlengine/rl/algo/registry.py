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
maps one group's per-token credits to per-token advantages (train.credit = "token"). An estimator
that needs per-token rewards or the response mask (response lengths, discounted returns, whitening
over tokens) has fn = None and a token_level_fn(rewards_BT, mask_BT, index_B, opts) -> [B, T]
(estimators.py); with `components` it also gets the named reward components (gdpo), with
`greedy_baseline` the reward of each prompt's greedy response (remax: the collector decodes it), with `needs` the
learner calls it in Learner.prepare with inputs of its own pre-update pass (optimal_token_baseline's
sum of squared probabilities). A critic estimator's fn is GAE-shaped (rewards_BT, values_BT, mask_BT, *, gamma, lam)
and runs in the learner, which owns the values. A policy loss has losses.policy_loss's signature plus
the keywords named in its `options` (train.* fields under verl's names); a loss with `select` (clip_cov,
kl_cov) gets the tokens it treats apart as `selected`, picked once over the whole batch.

Beyond grpo and gae, the estimators and losses carry verl 0.9.1's names and definitions
(core_algos.py; tests/rl/test_verl_parity.py checks them against values verl computed). train.algo
is a shorthand for one pairing; train.adv_estimator and train.policy_loss override its parts
(combination()).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from rlengine.model.config import ConfigError
from rlengine.rl.algo import cov_losses, estimators, policy_losses
from rlengine.rl.algo.advantages import gae, grpo_advantages, grpo_token_advantages
from rlengine.rl.algo.losses import policy_loss


@dataclass(frozen=True, slots=True)
class Estimator:
    """An advantage estimator."""

    name: str
    fn: Callable | None             # outcome: fn(rewards_PG, opts) -> [P, G]; critic: GAE-shaped (docstring)
    critic: bool                    # advantages from a learned value (the learner runs fn with its critic)
    group_relative: bool            # compares a prompt's G responses: G >= 2, dynamic sampling applies
    token_fn: Callable | None = None  # per-token credit: fn(credits_G, opts) -> [G][len]; None: sequence only
    # token-level: fn(rewards_BT, mask_BT, index_B, opts) -> [B, T] over right-aligned response rows
    token_level_fn: Callable | None = None
    # per-token inputs beyond rewards and mask; the learner computes the advantages (token_level_fn with
    # old_logp_BT and sum_pi_squared_BT) in Learner.prepare, from its pre-update pass
    needs: tuple[str, ...] = ()
    components: bool = False        # token-level fn also takes components_B: the named reward components (gdpo)
    # the rollout decodes one greedy response per prompt (rollout/baseline.py); the token-level fn takes
    # its reward as baseline_B [B] (remax)
    greedy_baseline: bool = False


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """A policy loss (losses.policy_loss's signature)."""

    name: str
    fn: Callable
    options: tuple[str, ...] = ()   # train.* fields the learner passes as keywords (verl's names)
    agg: str | None = None          # the aggregation the loss always uses (its normaliser); None = train.agg
    # select(logp, old_logp, adv, mask, **the loss's keywords) -> [T] bool: tokens the loss treats apart,
    # picked once over the whole update batch by the learner and passed to fn as `selected` (cov_losses.py)
    select: Callable | None = None


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
# per-token inputs the learner's pre-update pass computes for an estimator (learner/token_baseline.py)
LEARNER_SUPPLIES = {"sum_pi_squared"}
POLICY_LOSSES: dict[str, PolicyLoss] = {}
ALGORITHMS: dict[str, Algorithm] = {}


def register_estimator(name: str, *, critic: bool = False, group_relative: bool = True,
                       token_fn: Callable | None = None, token_level: bool = False, needs: tuple[str, ...] = (),
                       components: bool = False, greedy_baseline: bool = False):
    """Decorator: register fn as the advantage estimator `name` (token_level: fn is a token_level_fn)."""
    def add(fn):
        ESTIMATORS[name] = Estimator(name, None if token_level else fn, critic, group_relative and not critic,
                                     token_fn, fn if token_level else None, needs, components, greedy_baseline)
        return fn
    return add


def register_policy_loss(name: str, *, options: tuple[str, ...] = (), agg: str | None = None,
                         select: Callable | None = None):
    """Decorator: register fn as the policy loss `name`, reading train.<option> for each of `options`."""
    def add(fn):
        POLICY_LOSSES[name] = PolicyLoss(name, fn, options, agg, select)
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


def combination(name: str, adv_estimator: str = "", policy_loss: str = "") -> Algorithm:
    """train.algo `name` with train.adv_estimator / train.policy_loss overriding its parts ("" = its own).
    ConfigError naming the field for an unknown name or a pairing that cannot run: an estimator whose
    need for a critic differs from the algorithm's (train.algo decides whether a critic trains), or
    one that needs per-token inputs the learner does not compute (LEARNER_SUPPLIES)."""
    base = algorithm(name)
    est, loss = adv_estimator or base.estimator_name, policy_loss or base.loss_name
    if est not in ESTIMATORS:
        raise ConfigError(f"train.adv_estimator must be one of {'|'.join(ESTIMATORS)} (or \"\"), got {est!r}")
    if loss not in POLICY_LOSSES:
        raise ConfigError(f"train.policy_loss must be one of {'|'.join(POLICY_LOSSES)} (or \"\"), got {loss!r}")
    e = ESTIMATORS[est]
    if e.critic and not base.critic:
        raise ConfigError(f"train.adv_estimator = {est!r} needs a critic, which train.algo = {name!r} does not "
                          "train; use train.algo = 'ppo'")
    if base.critic and not e.critic:
        raise ConfigError(f"train.adv_estimator = {est!r} takes no critic, but train.algo = {name!r} trains one "
                          f"for {base.estimator_name!r}; use train.algo = 'grpo' with train.adv_estimator = {est!r}")
    if set(e.needs) - LEARNER_SUPPLIES:
        raise ConfigError(f"train.adv_estimator = {est!r} needs per-token {', '.join(e.needs)} from the rollout, "
                          "which rlengine does not record")
    if (est, loss) == (base.estimator_name, base.loss_name):
        return base
    critic = " + critic" if base.critic else ", no critic"
    return dataclasses.replace(base, estimator_name=est, loss_name=loss, summary=f"{est} + {loss}{critic}")


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
                             summary="grpo + vanilla, no critic"))
register_algorithm(Algorithm(name="ppo", estimator_name="gae", default_group_size=1,
                             options=("critic_lr_mult", "critic_warmup"),
                             summary="gae + vanilla + critic"))

# verl 0.9.1's estimators and losses (estimators.py, policy_losses.py, cov_losses.py)
register_estimator("rloo")(estimators.rloo)
register_estimator("grpo_passk")(estimators.grpo_passk)
register_estimator("gpg")(estimators.gpg)
register_estimator("opo", token_level=True)(estimators.opo)
register_estimator("reinforce_plus_plus_baseline", token_level=True)(estimators.reinforce_plus_plus_baseline)
register_estimator("reinforce_plus_plus", token_level=True, group_relative=False)(estimators.reinforce_plus_plus)
register_estimator("gdpo", token_level=True, components=True)(estimators.gdpo)
register_estimator("remax", token_level=True, group_relative=False, greedy_baseline=True)(estimators.remax)
register_estimator("optimal_token_baseline", token_level=True,
                   needs=("sum_pi_squared",))(estimators.optimal_token_baseline)
register_policy_loss("gspo")(policy_losses.gspo)
register_policy_loss("sapo", options=("tau_pos", "tau_neg"), agg="seq-mean")(policy_losses.sapo)
register_policy_loss("cispo")(policy_losses.cispo)
# GMPO's unit is every sequence: the count seq-mean-token-sum-norm divides by (its fn ignores train.agg)
register_policy_loss("geo_mean", agg="seq-mean-token-sum-norm")(policy_losses.geo_mean)
register_policy_loss("gpg")(policy_losses.gpg)
register_policy_loss("dro", options=("dro_beta",))(policy_losses.dro)
register_policy_loss("dppo_tv")(policy_losses.dppo_tv)
register_policy_loss("dppo_kl")(policy_losses.dppo_kl)
register_policy_loss("clip_cov", options=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
                     select=cov_losses.clip_cov_select)(cov_losses.clip_cov)
register_policy_loss("kl_cov", options=("kl_cov_ratio", "ppo_kl_coef"), select=cov_losses.kl_cov_select)(cov_losses.kl_cov)
