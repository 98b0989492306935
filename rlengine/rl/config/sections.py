"""The RL job's settings: one frozen dataclass per TOML section (TrainConfig, train_config.py, holds them).

Every value is first checked against its field's declared type (config_values.typed: a bool is not an int,
an int is accepted for a float, a list becomes a tuple), then validated in __post_init__ with a
message naming `section.field` and the allowed range; both raise ConfigError. Unknown keys (in a
file or an override) are errors, never silently ignored.
B_train = P * G retained responses per optimizer update: set either train.prompts_per_step
(P) or train.b_train (which must be divisible by G).

The config keeps what the user wrote: an assignment raises, and "0 = auto" values (gen.b_gen,
train.micro_batch, train.overlong_buffer, train.loss_norm_len, ...) stay 0. The plan stage
(rlengine/plan/) resolves them into specs. One normalisation happens at load, in the section
itself: train.group_size 0 becomes the algorithm's default G, and whichever of train.b_train and
train.prompts_per_step was set gives the other (B_train = P * G is the pair's definition).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rlengine.model.config import ConfigError
from rlengine.rl.algo.registry import ALGORITHMS, Algorithm, combination
from rlengine.rl.algo.schedule import LR_RULE_POWERS, lr_by_rule
from rlengine.rl.config.env_section import EnvSection
from rlengine.rl.config.update_options import AGGREGATIONS, UpdateOptions


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSection:
    """Which model the job trains (a preset or a HF checkpoint directory)."""

    name: str = "tiny"
    dtype: str = "float32"
    device: str = "auto"                 # auto = cuda if available else cpu
    moe_impl: str = "auto"               # auto (triton on a GPU, ref on a CPU; invariant with gen.batch_invariant) | ref | triton
    revision: str = ""                   # hub ids only: a branch, tag or commit sha ("" = the default branch)
    tokenizer: str = ""                  # a directory or hub id to take the tokenizer from ("" = the model's own)
    lora_r: int = 0                      # LoRA rank; 0 = full fine-tuning (no adapters)
    lora_alpha: float = 16.0             # LoRA scale = lora_alpha / lora_r
    lora_dropout: float = 0.0
    lora_target_modules: str | tuple[str, ...] = "all-linear"  # PEFT names (q_proj, ..., down_proj) or all-linear
    lora_path: str = ""                  # a PEFT adapter directory to start from ("" = a fresh adapter)
    lora_modules_to_save: str | tuple[str, ...] = ()  # PEFT's modules_to_save: lm_head, embed_tokens (full copies)

    def __post_init__(self):
        _check(self.lora_r >= 0, f"model.lora_r must be >= 1 (or 0 for no LoRA), got {self.lora_r}")
        if self.lora_r or self.lora_path:  # the spec's own checks (ConfigError naming the field)
            from rlengine.model.lora import lora_spec_of

            lora_spec_of(self)
        _check(bool(self.name), "model.name is required: a preset (tiny, ...) or a HF checkpoint directory "
                                "(--model.name DIR)")
        _check(self.revision == self.revision.strip() and self.tokenizer == self.tokenizer.strip(),
               "model.revision and model.tokenizer take no leading or trailing spaces")
        _check(not self.revision or "/" in self.name,
               f"model.revision {self.revision!r} names a commit of a Hugging Face hub id (org/name); "
               f"model.name {self.name!r} is not one")
        # float64 is for tests: runs on 1 and 2 ranks then agree token for token (no rounding flips)
        _check(self.dtype in ("float32", "bfloat16", "float16", "float64"),
               f"model.dtype must be float32|bfloat16|float16|float64, got {self.dtype!r}")
        _check(self.moe_impl in ("ref", "triton", "auto"), f"model.moe_impl must be ref|triton|auto, got {self.moe_impl!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskSection:
    """Where prompts and rewards come from."""

    name: str = "first-digit"            # built-in task name, or "jsonl"
    path: str = ""                       # JSONL file for name = "jsonl": {"prompt": ..., "answer": ...} per line
    eval_path: str = ""                  # optional held-out JSONL; else a split of `path`
    reward: str = ""                     # registered name (exact | math | format) or plugin "pkg.module:fn"; "" = the task's own
    num_train: int = 2000
    num_eval: int = 128
    seed: int = 1234
    max_reward_error_frac: float = 0.01  # rewards that raise score 0 up to this fraction of a batch; above: stop
    reward_workers: int = 0              # 0 = score in this process; > 0 = a spawned pool of this many workers
    reward_timeout: float = 30.0         # seconds per reward call in the pool; past it: scores 0, counted, worker replaced
    chat_template: bool = False          # wrap prompts as chat messages through the tokenizer's chat template
    system_prompt: str = ""              # with chat_template: the system message ("" = none)

    def __post_init__(self):
        _check(self.num_train >= 1 and self.num_eval >= 1, "task.num_train and task.num_eval must be >= 1")
        _check(0.0 <= self.max_reward_error_frac <= 1.0,
               f"task.max_reward_error_frac must be in [0, 1], got {self.max_reward_error_frac}")
        _check(self.reward_workers >= 0, f"task.reward_workers must be >= 0, got {self.reward_workers}")
        _check(self.reward_timeout > 0, f"task.reward_timeout must be > 0 seconds, got {self.reward_timeout}")
        _check(not self.system_prompt or self.chat_template,
               "task.system_prompt needs task.chat_template = true (a system message exists only in a chat)")
        if ":" in self.reward:  # a plugin: import it now, so a bad spec stops the job before anything is built
            from rlengine.rl.data.rewards import load_plugin

            load_plugin(self.reward)


@dataclass(frozen=True, slots=True, kw_only=True)
class GenSection:
    """The generator: B_gen and sampling."""

    b_gen: int = 0                       # responses in flight; 0 = B_train (coupled)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 8
    block_size: int = 16
    num_kv_blocks: int = 0               # 0 = sized from memory
    backend: str = "auto"
    max_lag: int = 1                     # drop partial rollouts older than this many updates (async)
    record_routing: bool = False         # MoE routing replay
    enforce_eager: bool = False          # GPU: no CUDA graphs for decode steps
    logprobs_mode: str = "processed"     # behaviour log-probs: processed (the filtered distribution) | raw
    # CPU kernels: measure (timed at first use) | cache (measured once per machine, ~/.cache/rlengine) |
    # torch | skinny | a saved table's .json path (pinned: a seeded run reproduces token for token)
    cpu_kernels: str = "cache"
    # one fixed-order kernel per op on the engine and the learner: sampled log-probs equal the
    # learner's recomputation bit for bit (CPU; model/batch_invariant.py)
    batch_invariant: bool = False
    # decode a GRPO group's shared prompt pages once per group (cascade attention; cpp / triton backends):
    # auto = the backend's measured default (on for cpp, off for triton) | true | false
    shared_prefix_decode: bool | str = "auto"
    # GPU decode layer path: torch (today's kernels; the default until a GPU run measures fused faster) |
    # fused (six launches a dense layer: model/fused_decode.py)
    decode_kernels: str = "torch"

    def __post_init__(self):
        _check(self.b_gen >= 0, f"gen.b_gen must be >= 0, got {self.b_gen}")
        _check(self.temperature > 0, f"gen.temperature must be > 0 for RL sampling, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"gen.top_p must be in (0, 1], got {self.top_p}")
        _check(self.max_tokens >= 1, f"gen.max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.max_lag >= 0, f"gen.max_lag must be >= 0, got {self.max_lag}")
        _check(self.logprobs_mode in ("raw", "processed"),
               f"gen.logprobs_mode must be raw|processed, got {self.logprobs_mode!r}")
        _check(self.cpu_kernels in ("measure", "cache", "torch", "skinny") or self.cpu_kernels.endswith(".json"),
               f"gen.cpu_kernels must be measure|cache|torch|skinny or a saved table's .json path, "
               f"got {self.cpu_kernels!r}")
        _check(self.decode_kernels in ("torch", "fused"),
               f"gen.decode_kernels must be torch|fused, got {self.decode_kernels!r}")
        _check(isinstance(self.shared_prefix_decode, bool) or self.shared_prefix_decode == "auto",
               f"gen.shared_prefix_decode must be auto, true or false, got {self.shared_prefix_decode!r}")

    @property
    def filtered(self) -> bool:
        """True when top-k or top-p changes the distribution sampled from."""
        return self.top_k > 0 or self.top_p < 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSection(UpdateOptions):
    """The learner: algorithm, batch knobs, optimiser and loss settings (the policy-update options
    it inherits, train.ppo_epochs to train.ref_offload, are in update_options.py)."""

    algo: str = "grpo"                   # a registered algorithm (rl/algo/registry.py): grpo | ppo
    group_size: int = 0                  # G; 0 = 8 for GRPO, 1 for PPO
    prompts_per_step: int = 16           # P
    b_train: int = 0                     # P*G; if set, P = b_train / G
    updates: int = 60                    # optimizer updates
    lr: float = 1e-3                     # eta0 at batch b0; 0 = a frozen policy (speed probes, controls)
    b0: int = 0                          # reference batch of the LR rule; 0 = this run's B_train
    lr_rule: str = "sqrt"                # sqrt | linear | none: eta = eta0 * (B/B0)^(1/2 | 1 | 0)
    weight_decay: float = 0.0
    master_weights: str = "auto"         # auto (fp32 when the model dtype is not fp32) | fp32 | none
    parallel: str = "auto"               # several ranks: none | ddp | fsdp; auto = ddp when world size > 1
    betas: tuple[float, float] = (0.9, 0.99)
    micro_batch: int = 0                 # sequences per micro-batch; 0 = the largest the memory plan fits
    max_grad_norm: float = 1.0
    # An update whose policy gradient is exactly 0 (GRPO: every group all-pass or all-fail, so every
    # advantage is 0) has nothing to learn; Adam would still move the weights on its momentum. true: no
    # optimizer step then (weights and moments untouched). false (the default job): step anyway.
    skip_zero_grad: bool = False
    clip_low: float = 0.2
    clip_high: float = 0.28
    agg: str = "token-mean"              # token-mean | seq-mean | seq-mean-token-sum-norm (Dr. GRPO)
    # GRPO credit assignment: sequence (one advantage per response, on each of its tokens) | token (each
    # token's own group-relative advantage from the task's per-token credit; tasks with Task.token_credit)
    credit: str = "sequence"
    normalize_std: bool = True
    kl_coef: float = 0.0                 # KL loss term (train.kl_estimator) to a frozen reference; 0 = none
    entropy_coef: float = 0.0
    dynamic_sampling: bool = True        # drop all-pass / all-fail groups (GRPO)
    priority_sampling: bool = True       # weight prompts by estimated pass rate near 0.5
    # PPO
    critic_lr_mult: float = 10.0
    critic_warmup: int = 0               # critic-only updates first; their responses are not counted in N
    # Over-long responses (cut at gen.max_tokens): none | mask (zero loss weight, still counted in N) |
    # soft (DAPO's soft overlong punishment over the last overlong_buffer tokens, added to the reward)
    overlong: str = "none"
    overlong_buffer: int = 0             # L_cache of "soft"; 0 = gen.max_tokens // 4
    # LR schedule on top of lr_effective: constant | linear | cosine, after warmup_updates of linear warm-up
    lr_schedule: str = "constant"
    warmup_updates: int = 0
    min_lr_ratio: float = 0.0            # linear / cosine decay to min_lr_ratio * lr at the last update
    gamma: float = 1.0
    lam: float = 0.95
    vf_clip: float = 0.2
    vf_coef: float = 1.0

    def __post_init__(self):
        algo = self.algorithm  # train.algo with train.adv_estimator / train.policy_loss applied
        if self.group_size == 0:  # the load-time normalisation of the module docstring
            object.__setattr__(self, "group_size", algo.default_group_size)
        _check(self.group_size >= 1, f"train.group_size must be >= 1, got {self.group_size}")
        _check(not algo.group_relative or self.group_size >= 2,
               f"train.group_size must be >= 2 for {self.algo} (got {self.group_size}): with one response per "
               "prompt the group-relative advantage is always 0 and nothing is learned")
        _check(self.parallel in ("auto", "none", "ddp", "fsdp"),
               f"train.parallel must be auto|none|ddp|fsdp, got {self.parallel!r}")
        _check(self.master_weights in ("auto", "fp32", "none"),
               f"train.master_weights must be auto|fp32|none, got {self.master_weights!r}")
        _check(self.b_train >= 0, f"train.b_train must be >= 1 responses per update (or 0: P x G from "
                                  f"train.prompts_per_step), got {self.b_train}")
        if self.b_train:
            _check(self.b_train % self.group_size == 0,
                   f"train.b_train ({self.b_train}) must be divisible by train.group_size G ({self.group_size})")
            object.__setattr__(self, "prompts_per_step", self.b_train // self.group_size)
        _check(self.prompts_per_step >= 1, f"train.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        object.__setattr__(self, "b_train", self.prompts_per_step * self.group_size)
        _check(self.updates >= 1, f"train.updates must be >= 1, got {self.updates}")
        _check(self.lr >= 0, f"train.lr must be >= 0 (0: a frozen policy), got {self.lr}")
        _check(self.lr_rule in LR_RULE_POWERS, f"train.lr_rule must be {'|'.join(LR_RULE_POWERS)}, got {self.lr_rule!r}")
        _check(self.agg in AGGREGATIONS, f"train.agg must be {'|'.join(AGGREGATIONS)}, got {self.agg!r}")
        _check(self.credit in ("sequence", "token"), f"train.credit must be sequence|token, got {self.credit!r}")
        _check(self.credit == "sequence" or algo.estimator.token_fn is not None,
               f"train.credit = 'token' needs an estimator with per-token credit (grpo); train.algo = {self.algo!r} "
               f"uses {algo.estimator_name!r}" + (", whose critic assigns credit per token already" if algo.critic else ""))
        _check(0 <= self.clip_low < 1 and self.clip_high >= 0, "train.clip_low must be in [0, 1) and clip_high >= 0")
        _check(self.micro_batch >= 0, f"train.micro_batch must be >= 0, got {self.micro_batch}")
        _check(0 < self.gamma <= 1 and 0 <= self.lam <= 1, "train.gamma must be in (0, 1] and train.lam in [0, 1]")
        _check(self.overlong in ("none", "mask", "soft"), f"train.overlong must be none|mask|soft, got {self.overlong!r}")
        _check(self.overlong_buffer >= 0, f"train.overlong_buffer must be >= 0, got {self.overlong_buffer}")
        _check(self.lr_schedule in ("constant", "linear", "cosine"),
               f"train.lr_schedule must be constant|linear|cosine, got {self.lr_schedule!r}")
        _check(0 <= self.warmup_updates < self.updates,
               f"train.warmup_updates must be in [0, train.updates = {self.updates}), got {self.warmup_updates}")
        _check(0.0 <= self.min_lr_ratio <= 1.0, f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        self.check_update_options(algo=algo, parallel=self.parallel, credit=self.credit, b_train=self.b_train)
        self._check_algorithm_options(algo)

    def _check_algorithm_options(self, algo) -> None:
        """An option that belongs to other algorithms (Algorithm.options) keeps its default here."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for other in ALGORITHMS.values():
            for name in other.options:
                _check(name in algo.options or getattr(self, name) == defaults[name],
                       f"train.{name} is an option of train.algo = {other.name!r}, not of {algo.name!r}; "
                       f"leave it at its default ({defaults[name]!r})")

    @property
    def algorithm(self) -> Algorithm:
        """The estimator, policy loss and critic this job trains with: train.algo's pairing, with
        train.adv_estimator / train.policy_loss in place of its parts when set (registry.combination)."""
        return combination(self.algo, self.adv_estimator, self.policy_loss)

    @property
    def lr_effective(self) -> float:
        """eta = eta0 * (B_train / B0)^p with p = 1/2 (sqrt), 1 (linear) or 0 (none) (schedule.lr_by_rule)."""
        return lr_by_rule(self.lr, self.b_train, self.b0, self.lr_rule)


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmStartSection:
    """Optional supervised warm start (teaches the answer FORMAT only, with random answers)."""

    steps: int = 0
    lr: float = 3e-3
    batch: int = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalSection:
    every: int = 5                       # updates between evaluations (and at 0 and the end)
    every_responses: int = 0             # if > 0: evaluate each time N crosses a multiple of this (not `every`)
    k: int = 1                           # mean@k samples per prompt
    temperature: float = 0.0             # 0 = greedy
    # Named eval sets, {name = "path.jsonl", ...} (TOML table [eval.sets] or an inline table); each is
    # logged as eval/<name>/mean@k and eval/<name>/pass@k. Empty: one set, "heldout" = the task's split.
    sets: dict[str, str] = field(default_factory=dict)
    primary: str = ""                    # the set whose mean@k is J (N*, accounting); "" = the first
    pass_threshold: float = 1.0          # pass@k: a sample is correct when its reward >= this

    def __post_init__(self):
        _check(self.every >= 1, f"eval.every must be >= 1, got {self.every}")
        _check(self.every_responses >= 0, f"eval.every_responses must be >= 0, got {self.every_responses}")
        _check(self.k >= 1, f"eval.k must be >= 1, got {self.k}")
        _check(self.temperature >= 0, f"eval.temperature must be >= 0, got {self.temperature}")
        _check(isinstance(self.sets, dict) and all(isinstance(k, str) and k and isinstance(v, str) and v
                                                   for k, v in self.sets.items()),
               f"eval.sets must be a table of name = \"path.jsonl\" entries, got {self.sets!r}")
        _check(all("/" not in k for k in self.sets), f"eval.sets names may not contain '/': {sorted(self.sets)}")
        names = list(self.sets) or ["heldout"]
        _check(not self.primary or self.primary in names,
               f"eval.primary = {self.primary!r} is not an eval set; sets: {', '.join(names)}")

    @property
    def set_names(self) -> list[str]:
        """The eval sets' names in order ("heldout" when eval.sets is empty)."""
        return list(self.sets) or ["heldout"]

    @property
    def primary_set(self) -> str:
        return self.primary or self.set_names[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSection:
    name: str = ""                       # the run's label (plots, reports); "" = out_dir's last part
    out_dir: str = "runs/default"        # with name set and out_dir left at its default: runs/<name> (run_dir)
    seed: int = 0
    checkpoint_every: int = 0            # updates; 0 = only at the end
    progress: bool = True
    samples_every: int = 0               # every k updates append the batch's responses to samples.jsonl; 0 = never
    tensorboard: bool = False            # also write metrics as TensorBoard event files in out_dir
    wandb: bool = False                  # also log metrics to Weights & Biases (WANDB_MODE=offline works)
    wandb_project: str = "rlengine"      # its project; the run is named after out_dir
    overwrite: bool = False              # a new run may replace the run already in out_dir (else an error)
    keep_checkpoints: int = 0            # keep the newest K checkpoints; 0 = all
    dist_timeout_s: float = 300.0        # a collective that waits longer than this fails the job (several ranks)
    save_timeout_s: float = 21600.0      # how long ranks wait for a checkpoint save (its own group)
    async_checkpoint: bool = False       # write checkpoints in the background while training goes on
    warmstart_cache: str = ""            # directory of warm-started weights shared by runs ("" = none)

    def __post_init__(self):
        _check("/" not in self.name and self.name not in (".", ".."),
               f"run.name must be a plain name (no '/'), got {self.name!r}")
        _check(bool(self.out_dir.strip()), "run.out_dir is empty; give a directory for the run (e.g. runs/my-run)")
        _check(self.samples_every >= 0, f"run.samples_every must be >= 0, got {self.samples_every}")
        _check(self.dist_timeout_s > 0, f"run.dist_timeout_s must be > 0 seconds, got {self.dist_timeout_s}")
        _check(self.save_timeout_s > 0, f"run.save_timeout_s must be > 0 seconds, got {self.save_timeout_s}")
        _check(self.keep_checkpoints >= 0, f"run.keep_checkpoints must be >= 0 (0 keeps all), got {self.keep_checkpoints}")
        if self.tensorboard:
            import importlib.util

            _check(importlib.util.find_spec("tensorboard") is not None,
                   "run.tensorboard = true needs the tensorboard package (`pip install tensorboard`)")
        _check(bool(self.wandb_project), "run.wandb_project must be a non-empty project name")
        if self.wandb:
            import importlib.util
            import sys

            _check(sys.modules.get("wandb") is not None or importlib.util.find_spec("wandb") is not None,
                   "run.wandb = true needs the wandb package (`pip install rlengine[wandb]`)")


_SECTION_TYPES = {"model": ModelSection, "task": TaskSection, "gen": GenSection, "train": TrainSection,
                  "warmstart": WarmStartSection, "eval": EvalSection, "run": RunSection,
                  "env": EnvSection}  # multi-turn environments: rl/config/env_section.py
