"""The [train] settings that shape how one rollout batch becomes updates: passes, loss form, corrections.

TrainSection (sections.py) inherits these fields, so they are ordinary train.* keys. They sit apart
because they all change the policy update inside Learner.step, not the job around it: PPO epochs
and mini-batches, the KL estimator and where the KL goes (loss or reward), dual-clip, Dr. GRPO's
constant normaliser, batch whitening, rollout importance sampling, and two memory knobs (layer
checkpointing, a host-resident KL reference). Every default reproduces the one-pass update the
learner ran before these options existed. The verl / TRL names are in the README's option table.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlengine.model.config import ConfigError
from rlengine.rl.algo.registry import POLICY_LOSSES
from rlengine.rl.algo.rollout_is import parse_threshold
from rlengine.rl.algo.rollout_rs import parse_criteria

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
AGGREGATIONS = ("token-mean", "seq-mean", "seq-mean-token-sum-norm")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateOptions:
    """Policy-update settings of [train] (see the module docstring)."""

    ppo_epochs: int = 1                  # passes over each rollout batch
    # optimizer steps per pass: the batch split into this many parts of whole sequences (several ranks:
    # mini-batch i is every rank's i-th part of its own share, so which responses share a step differs
    # from one process's split; ppo_epochs alone keeps the one-process equality)
    mini_batches: int = 1
    kl_estimator: str = "k3"             # k1 | k2 | k3 | low_var_kl (k3 clamped to [-10, 10], as verl)
    # KL folded into the token reward (PPO-style), with its OWN coefficient kl_reward_coef (train.kl_coef
    # stays the loss term's); both may be on. GRPO: each response's score becomes reward - coef * sum_t kl_t
    kl_in_reward: bool = False
    kl_reward_coef: float = 0.001
    clip_ratio_c: float | None = None    # dual-clip bound for negative advantages (> 1); None = off
    loss_norm_len: int = 0               # seq-mean-token-sum-norm's constant length; 0 = gen.max_tokens
    adv_whiten: str = "none"             # none | batch: GRPO advantages whitened over the batch's tokens
    rollout_is: str = "none"             # none | token | sequence: truncated IS weights learner_old / engine
    rollout_is_cap: float = 2.0          # truncation of the rollout IS weights
    # verl's threshold specification, overriding the cap: "U" truncates at U (TIS), "L:U" (or "L_U") zeroes
    # weights outside [L, U] (IcePop); "" = rollout_is_cap as the upper bound
    rollout_is_threshold: str = ""
    rollout_is_batch_normalize: bool = False  # divide the IS weights by their batch mean (tokens or sequences)
    rollout_rs: str = ""                 # rejection criteria, comma-chained (token_k1, seq_sum_k3, ...); "" = none
    rollout_rs_threshold: str = ""       # one threshold, or one per criterion ("L:U" for k1 criteria)
    activation_checkpointing: bool = False  # recompute each decoder layer in the backward
    ref_offload: bool = False            # KL reference's decoder layers on the host, streamed per layer
    # The algorithm's parts (rl/algo/registry.py, verl's names): "" = train.algo's own
    adv_estimator: str = ""              # grpo | rloo | grpo_passk | gpg | opo | reinforce_plus_plus[_baseline] | ...
    policy_loss: str = ""                # vanilla | gspo | sapo | cispo | geo_mean | gpg | dro | dppo_tv | ...
    # Options of single losses, under verl's names (each only with its loss)
    tau_pos: float = 1.0                 # sapo: gate temperature where A > 0
    tau_neg: float = 1.05                # sapo: gate temperature where A <= 0
    clip_cov_ratio: float = 0.0002       # clip_cov: fraction of tokens whose gradient may be cut
    clip_cov_lb: float = 1.0             # clip_cov: covariance window (lb, ub) of the candidates
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002         # kl_cov: fraction of tokens (top covariance) given the |log r| penalty
    ppo_kl_coef: float = 0.1             # kl_cov: that penalty's coefficient
    dro_beta: float | None = None        # dro: the quadratic log-ratio penalty (> 0, required with dro)
    # gdpo: the reward components (keys of a dict-returning reward) it normalises, and their weights;
    # no keys: the reward itself is the one component (verl's fallback)
    gdpo_reward_keys: tuple[str, ...] = ()
    gdpo_reward_weights: tuple[float, ...] = ()  # () = 1 each

    def check_update_options(self, *, algo, parallel: str, credit: str, b_train: int) -> None:
        """Validate the fields above (TrainSection.__post_init__ calls this); raises ConfigError."""
        _check(self.ppo_epochs >= 1, f"train.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        _check(1 <= self.mini_batches <= b_train,
               f"train.mini_batches must be in [1, B_train = {b_train}], got {self.mini_batches}")
        _check(self.kl_estimator in KL_ESTIMATORS,
               f"train.kl_estimator must be {'|'.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        _check(self.kl_reward_coef >= 0, f"train.kl_reward_coef must be >= 0, got {self.kl_reward_coef}")
        _check(not self.kl_in_reward or self.kl_reward_coef > 0,
               "train.kl_in_reward = true needs train.kl_reward_coef > 0")
        _check(not (self.kl_in_reward and credit == "token"),
               "train.kl_in_reward works on sequence credit; train.credit = 'token' has its own token advantages")
        _check(self.clip_ratio_c is None or self.clip_ratio_c > 1.0,
               f"train.clip_ratio_c must be > 1 (or unset for no dual-clip), got {self.clip_ratio_c}")
        _check(self.loss_norm_len >= 0, f"train.loss_norm_len must be >= 0 (0 = gen.max_tokens), got {self.loss_norm_len}")
        _check(self.adv_whiten in ("none", "batch"), f"train.adv_whiten must be none|batch, got {self.adv_whiten!r}")
        _check(self.adv_whiten == "none" or not algo.critic,
               "train.adv_whiten = 'batch' whitens outcome advantages; a critic's GAE advantages are always whitened")
        _check(self.rollout_is in ("none", "token", "sequence"),
               f"train.rollout_is must be none|token|sequence, got {self.rollout_is!r}")
        _check(self.rollout_is_cap >= 1.0, f"train.rollout_is_cap must be >= 1, got {self.rollout_is_cap}")
        self._check_rollout_correction()
        self._check_loss_options(algo)
        gdpo = algo.estimator.components
        _check(gdpo or not (self.gdpo_reward_keys or self.gdpo_reward_weights),
               "train.gdpo_reward_keys / train.gdpo_reward_weights are options of train.adv_estimator = 'gdpo'")
        _check(len(self.gdpo_reward_weights) in (0, len(self.gdpo_reward_keys)),
               f"train.gdpo_reward_weights must be empty or one per key of train.gdpo_reward_keys "
               f"({len(self.gdpo_reward_keys)}), got {len(self.gdpo_reward_weights)}")
        _check(not (self.kl_in_reward and algo.estimator.fn is None and not algo.critic),
               f"train.kl_in_reward folds the KL into [P, G] scores; train.adv_estimator = {algo.estimator_name!r} "
               "works on token rewards (leave kl_in_reward false)")
        _check(not (self.ref_offload and parallel == "fsdp"),
               "train.ref_offload streams a whole reference per layer; with train.parallel = 'fsdp' the reference "
               "is sharded instead (leave ref_offload false)")

    def _check_rollout_correction(self) -> None:
        """The rollout correction's specifications parse (rl/algo/rollout_correction.py) and fit together."""
        _check(not (self.rollout_is_threshold and self.rollout_is_cap != 2.0),
               "train.rollout_is_threshold and train.rollout_is_cap both set the IS weights' upper bound; set one")
        _check(not self.rollout_is_batch_normalize or self.rollout_is != "none",
               "train.rollout_is_batch_normalize needs train.rollout_is = token | sequence")
        _check(bool(self.rollout_rs) == bool(self.rollout_rs_threshold),
               "train.rollout_rs and train.rollout_rs_threshold go together (criteria and their thresholds)")
        try:
            parse_threshold(self.rollout_is_threshold or self.rollout_is_cap)
        except ValueError as e:
            raise ConfigError(f"train.rollout_is_threshold: {e}") from None
        try:
            if self.rollout_rs:
                parse_criteria(self.rollout_rs, self.rollout_rs_threshold)
        except ValueError as e:
            raise ConfigError(f"train.rollout_rs: {e}") from None

    def _check_loss_options(self, algo) -> None:
        """The selected loss's options in range; another loss's options at their defaults."""
        loss = algo.loss_name
        _check(self.tau_pos > 0 and self.tau_neg > 0,
               f"train.tau_pos and train.tau_neg must be > 0, got {self.tau_pos}, {self.tau_neg}")
        _check(self.clip_cov_ratio > 0 and self.kl_cov_ratio > 0,
               f"train.clip_cov_ratio and train.kl_cov_ratio must be > 0, got {self.clip_cov_ratio}, {self.kl_cov_ratio}")
        _check(self.clip_cov_lb < self.clip_cov_ub,
               f"train.clip_cov_lb must be < train.clip_cov_ub, got {self.clip_cov_lb}, {self.clip_cov_ub}")
        _check(loss != "dro" or (self.dro_beta is not None and self.dro_beta > 0),
               f"train.policy_loss = 'dro' needs train.dro_beta > 0, got {self.dro_beta}")
        defaults = {f: UpdateOptions.__dataclass_fields__[f].default for p in POLICY_LOSSES.values() for f in p.options}
        for other in POLICY_LOSSES.values():
            for name in other.options:
                _check(name in POLICY_LOSSES[loss].options or getattr(self, name) == defaults[name],
                       f"train.{name} is an option of train.policy_loss = {other.name!r}, not of {loss!r}; "
                       f"leave it at its default ({defaults[name]!r})")
