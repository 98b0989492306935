"""The plan's specs: what will run, resolved once from the job's config, the device and the model.

TrainConfig (rl/config) keeps what the user wrote, "0 = auto" included. The plan stage resolves it
into these frozen records, and everything below the plan (the rollout collector, the learner, the
engines the trainer builds) reads them, never the raw config:

    RolloutSpec   groups (P, G, B_train), B_gen and lag, sampling, dynamic sampling, rewards
    EngineSpec    one engine's sizes and kernels: B_gen (max_num_seqs), KV blocks, backend, modes
                  (the engine's own record, rlengine/engine/spec.py: LLM.from_spec builds from it)
    LearnerSpec   the algorithm and its options, micro-batch, LR, precision and parallelism
    JobPlan       the three above, the eval engine's spec, the memory plan and the run directory

resolve_rollout / resolve_learner hold the arithmetic that needs only the config; the device- and
model-dependent parts (KV blocks, micro-batch, max_model_len) come from plan/job.py. JobPlan.to_dict
is what `rlengine info --plan` prints and the run directory keeps as plan.json.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlengine.engine.spec import EngineSpec
from rlengine.rl.algo.registry import Algorithm
from rlengine.rl.config import TrainConfig, TrainSection


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutSpec:
    """How rollouts are made and kept for one update."""

    group_size: int              # G responses per prompt
    prompts_per_step: int        # P prompts per update
    b_train: int                 # B_train = P * G retained responses per optimizer update
    b_gen: int                   # responses in flight (B_gen >= B_train; > B_train: async partial rollouts)
    max_lag: int                 # partial rollouts older than this many updates are dropped
    max_tokens: int              # response length cap
    dynamic_sampling: bool       # drop groups with no signal (only for group-relative estimators)
    token_credit: bool           # per-token credit (train.credit = "token")
    overlong: str                # none | mask | soft
    overlong_buffer: int         # DAPO's L_cache (soft), resolved from gen.max_tokens when 0
    greedy_baseline: bool = False  # one greedy response per prompt beside its group (remax's baseline)

    @property
    def async_mode(self) -> bool:
        return self.b_gen > self.b_train


@dataclass(frozen=True, slots=True, kw_only=True)
class LearnerSpec:
    """The learner: the algorithm with its options, and the values resolved for this job."""

    algo: str                    # a registered algorithm (rl/algo/registry.py)
    options: TrainSection        # train.* as the user wrote them (clip, KL, agg, PPO passes, ...)
    group_size: int              # G (the KL-in-reward estimator regroups the packed batch by it)
    micro_batch: int             # sequences per micro-batch (0: the rank's whole share)
    lr: float                    # eta = eta0 * (B_train / B0)^p (train.lr_rule), before the schedule
    loss_norm_len: int           # seq-mean-token-sum-norm's constant, resolved from gen.max_tokens when 0
    temperature: float           # the log-prob definition: log_softmax(logits / T), as the engine's
    logprobs_mode: str           # raw | processed (filtered by top-k / top-p)
    top_k: int
    top_p: float
    replay_routing: bool         # MoE: replay the engine's expert choices

    @property
    def algorithm(self) -> Algorithm:
        """train.algo with train.adv_estimator / train.policy_loss in place of its parts (registry.combination)."""
        return self.options.algorithm

    @staticmethod
    def from_options(options: TrainSection, *, temperature: float = 1.0, replay_routing: bool = False,
                     logprobs_mode: str = "raw", top_k: int = -1, top_p: float = 1.0,
                     loss_norm_len: int | None = None) -> "LearnerSpec":
        """A learner spec from train.* alone (callers without a job: benches, tests). micro_batch is
        train.micro_batch as written (0: no split); loss_norm_len defaults to train.loss_norm_len."""
        return LearnerSpec(algo=options.algo, options=options, group_size=options.group_size,
                           micro_batch=options.micro_batch, lr=options.lr_effective,
                           loss_norm_len=options.loss_norm_len if loss_norm_len is None else loss_norm_len,
                           temperature=temperature, logprobs_mode=logprobs_mode, top_k=top_k, top_p=top_p,
                           replay_routing=replay_routing)


def saved_micro_batch(run_dir) -> int | None:
    """The learner micro-batch a run directory's plan.json recorded (None: no plan there, e.g. a run
    written before the plan stage; 0: the rank's whole share)."""
    import json
    from pathlib import Path

    path = Path(run_dir) / "plan.json"
    try:
        return int(json.loads(path.read_text())["learner"]["micro_batch"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolve_rollout(cfg: TrainConfig) -> RolloutSpec:
    """The rollout's spec: every value from the config, "0 = auto" resolved."""
    t, g = cfg.train, cfg.gen
    return RolloutSpec(group_size=t.group_size, prompts_per_step=t.prompts_per_step, b_train=t.b_train,
                       b_gen=cfg.b_gen, max_lag=g.max_lag, max_tokens=g.max_tokens,
                       dynamic_sampling=t.dynamic_sampling and t.algorithm.group_relative,
                       token_credit=t.credit == "token", overlong=t.overlong, overlong_buffer=cfg.overlong_buffer,
                       greedy_baseline=t.algorithm.estimator.greedy_baseline)


def resolve_learner(cfg: TrainConfig, micro_batch: int) -> LearnerSpec:
    """The learner's spec with the micro-batch the plan chose (0: the rank's whole share)."""
    g = cfg.gen
    return dataclasses.replace(
        LearnerSpec.from_options(cfg.train, temperature=g.temperature, replay_routing=g.record_routing,
                                 logprobs_mode=g.logprobs_mode, top_k=g.top_k, top_p=g.top_p,
                                 loss_norm_len=cfg.loss_norm_len),
        micro_batch=micro_batch)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobPlan:
    """Everything resolved for one rank's job."""

    run_dir: str                 # where the run writes (run.out_dir, or runs/<run.name>)
    rollout: RolloutSpec
    engine: EngineSpec           # the rollout engine
    eval_engine: EngineSpec      # the eval engine (shares the rollout engine's KV pool)
    learner: LearnerSpec
    memory: object               # analysis.memory_plan.MemoryPlan of this device

    def to_dict(self) -> dict:
        """Plain values for plan.json and `rlengine info --plan` (the learner's options are the config's)."""
        learner = {f.name: getattr(self.learner, f.name) for f in dataclasses.fields(self.learner)
                   if f.name != "options"}
        mem = self.memory
        memory = {k: getattr(mem, k) for k in ("micro_batch", "num_kv_blocks", "b_kv", "b_gen", "max_model_len",
                                               "device_bytes", "activations", "fits") if hasattr(mem, k)}
        return {"run_dir": self.run_dir, "rollout": dataclasses.asdict(self.rollout),
                "engine": dataclasses.asdict(self.engine), "eval_engine": dataclasses.asdict(self.eval_engine),
                "learner": learner, "memory": memory}


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanChange:
    """A change to a job's plan, as a tuner compares configurations: the rollout's batch and
    concurrency, the learner's LR rule, the engine's KV pool and the run's length. None keeps the
    job's own value. apply() gives the changed config (a new frozen TrainConfig, validated as a
    loaded one); overrides() is the same change as `section.key` pairs for files a person reads
    (chosen.toml, tune_run.json). _FIELDS is the one place the fields meet the config's keys."""

    b_train: int | None = None           # RolloutSpec.b_train (P = B_train / G)
    b_gen: int | None = None             # RolloutSpec.b_gen (0: coupled, = B_train)
    max_lag: int | None = None           # RolloutSpec.max_lag
    lr: float | None = None              # eta0 at b0 (LearnerSpec.lr = the LR rule's eta from it)
    b0: int | None = None                # the LR rule's reference batch
    lr_rule: str | None = None           # sqrt | linear | none
    num_kv_blocks: int | None = None     # EngineSpec.num_kv_blocks (an emulated KV capacity)
    updates: int | None = None           # the run's optimizer updates
    eval_every_responses: int | None = None  # the evaluation grid on the N axis

    _FIELDS = {"b_train": ("train", "b_train"), "b_gen": ("gen", "b_gen"), "max_lag": ("gen", "max_lag"),
               "lr": ("train", "lr"), "b0": ("train", "b0"), "lr_rule": ("train", "lr_rule"),
               "num_kv_blocks": ("gen", "num_kv_blocks"), "updates": ("train", "updates"),
               "eval_every_responses": ("eval", "every_responses")}

    def values(self) -> dict:
        """The fields this change sets (name -> value), in declaration order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def overrides(self) -> tuple[tuple[str, object], ...]:
        """The change as (section.key, value) pairs."""
        return tuple((".".join(self._FIELDS[k]), v) for k, v in self.values().items())

    def apply_to_dict(self, job: dict) -> dict:
        """A copy of a config dict (TrainConfig.to_dict()) with this change; B_train also sets P = B_train / G."""
        d = {s: dict(v) if isinstance(v, dict) else v for s, v in job.items()}
        for name, value in self.values().items():
            section, key = self._FIELDS[name]
            d[section][key] = value
            if name == "b_train":  # the pair's other half follows (both are in a saved config)
                d["train"]["prompts_per_step"] = 0
        return d

    def apply(self, cfg: TrainConfig) -> TrainConfig:
        """cfg with this change, validated (ConfigError as for a loaded config); cfg is unchanged."""
        return TrainConfig.from_dict(self.apply_to_dict(cfg.to_dict()))

    @staticmethod
    def from_overrides(pairs) -> "PlanChange":
        """The change of (section.key, value) pairs (tune_run.json, a worker's task); a key no field maps
        to is a ValueError."""
        by_key = {".".join(v): k for k, v in PlanChange._FIELDS.items()}
        unknown = [k for k, _ in pairs if k not in by_key]
        if unknown:
            raise ValueError(f"PlanChange: no field for {unknown}; known: {sorted(by_key)}")
        return PlanChange(**{by_key[k]: v for k, v in pairs})
