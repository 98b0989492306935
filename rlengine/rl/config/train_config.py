"""TrainConfig: the job's config, its seven sections (sections.py) together.

It checks what spans sections (B_gen against B_train and G, the over-long buffer against
gen.max_tokens), exposes the values that "0 = auto" stands for, resolved from the config alone
(b_gen, overlong_buffer, loss_norm_len, run_dir: read by the plan stage, rlengine/plan/specs.py),
and reads a config dict section by section with unknown sections and keys refused.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from rlengine.rl.config.sections import (_SECTION_TYPES, EvalSection, GenSection, ModelSection, RunSection,
                                         TaskSection, TrainSection, WarmStartSection, _check)
from rlengine.rl.config.env_section import EnvSection
from rlengine.rl.config.values import typed


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    task: TaskSection = field(default_factory=TaskSection)
    gen: GenSection = field(default_factory=GenSection)
    train: TrainSection = field(default_factory=TrainSection)
    warmstart: WarmStartSection = field(default_factory=WarmStartSection)
    eval: EvalSection = field(default_factory=EvalSection)
    run: RunSection = field(default_factory=RunSection)
    env: EnvSection = field(default_factory=EnvSection)

    def __post_init__(self):
        b_gen = self.gen.b_gen or self.train.b_train
        _check(b_gen >= self.train.group_size,
               f"gen.b_gen ({b_gen}) must hold at least one group of G={self.train.group_size} responses")
        _check(b_gen >= self.train.b_train,
               f"gen.b_gen ({b_gen}) must be >= train.b_train ({self.train.b_train}): B_gen counts the responses in "
               "flight, at least one update's worth (0 = B_train, coupled; larger = async partial rollouts); the KV "
               "pool (gen.num_kv_blocks) is what bounds how many decode at once")
        _check(self.env.max_turn_tokens <= self.gen.max_tokens,
               f"env.max_turn_tokens ({self.env.max_turn_tokens}) must be <= gen.max_tokens ({self.gen.max_tokens}), "
               "a trajectory's whole budget after its prompt")
        t = self.train
        _check(not (t.algorithm.estimator.greedy_baseline and self.env.name),
               f"train.adv_estimator = {t.algorithm.estimator_name!r} decodes one greedy single-turn response per "
               f"prompt as its baseline; multi-turn rollouts (env.name = {self.env.name!r}) have none: "
               "leave env.name empty")
        if t.overlong == "soft":
            _check(self.overlong_buffer <= self.gen.max_tokens,
                   f"train.overlong_buffer ({self.overlong_buffer}) must be <= gen.max_tokens ({self.gen.max_tokens})")

    # Values resolved from the config alone ("0 = auto" read from the sections they depend on). The plan
    # stage puts them into its specs (rlengine/plan/specs.py); nothing below the plan reads them here.
    @property
    def b_gen(self) -> int:
        """B_gen: gen.b_gen, or B_train (coupled) when it is 0."""
        return self.gen.b_gen or self.train.b_train

    @property
    def overlong_buffer(self) -> int:
        """DAPO's L_cache: train.overlong_buffer, or max(1, gen.max_tokens // 4) when it is 0."""
        return self.train.overlong_buffer or max(1, self.gen.max_tokens // 4)

    @property
    def loss_norm_len(self) -> int:
        """Dr. GRPO's constant length: train.loss_norm_len, or gen.max_tokens (the longest response) when 0."""
        return self.train.loss_norm_len or self.gen.max_tokens

    @property
    def run_dir(self) -> str:
        """Where the run writes: run.out_dir, or runs/<run.name> when a name is set and out_dir is the default."""
        r = self.run
        return f"runs/{r.name}" if r.name and r.out_dir == "runs/default" else r.out_dir

    @property
    def attention_backend(self) -> str:
        """The engines' backend: gen.backend, except that auto on a float64 model is torch (the fp64 oracle)."""
        return "torch" if self.gen.backend == "auto" and self.model.dtype == "float64" else self.gen.backend

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(sections))
        _check(not unknown, f"unknown config section(s): {', '.join(unknown)}; known: {', '.join(sections)}")
        built = {}
        for name in sections:
            section_cls = _SECTION_TYPES[name]
            _check(isinstance(d.get(name, {}), dict),
                   f"config section [{name}] must be a table of key = value lines, got {d.get(name)!r}")
            values = dict(d.get(name, {}))
            known = {f.name for f in dataclasses.fields(section_cls)}
            bad = sorted(set(values) - known)
            _check(not bad, f"unknown config key(s) {', '.join(f'{name}.{k}' for k in bad)}; "
                            f"known in [{name}]: {', '.join(sorted(known))}")
            hints = typing.get_type_hints(section_cls)
            values = {k: typed(f"{name}.{k}", v, hints[k]) for k, v in values.items()}
            built[name] = section_cls(**values)
        return cls(**built)
