"""Typed inputs and outputs of `rlengine tune` (docs/METHOD.md Algorithm 1), stage by stage.

    TuneSpec -> stage 1: RunPlan per (B_train, seed) -> RunCurve -> CandidateStats -> Stage1Result
             -> stage 2: GenSweep per surviving B_train (GenPoint per B_gen), re-check CandidateStats
             -> choice: TableRow per configuration, Choice, Confirmation -> TuneResult
Every object is a frozen dataclass of plain values (numbers, strings, tuples), so a notebook can
build, inspect and `dataclasses.asdict` any of them; the report writer serialises them as JSON.
Units: N in retained training responses, times in seconds of wall-clock (t_gen + t_train of the
updates, evaluation excluded), q in responses per second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlengine.plan.specs import PlanChange


@dataclass(frozen=True, slots=True, kw_only=True)
class TuneSpec:
    """What to tune: the job, the target, the candidates and the budgets."""

    job: dict                            # the job's TrainConfig.to_dict() (the reference configuration)
    target_j: float                      # J*
    b_train: tuple[int, ...]             # candidate B_train = P*G, each divisible by G
    b0: int = 0                          # reference batch of the sqrt rule; 0 = the job's B_train
    eta0: float = 0.0                    # LR at b0; 0 = the job's train.lr
    seeds: tuple[int, ...] = (0, 1, 2)   # run.seed of each replicate
    n_max: int = 0                       # response budget of every curve; 0 = the job's updates * B_train
    eval_every: int = 0                  # eval.every_responses; 0 = ~N_max / 100 (stage1.budgets)
    stop_at_target: bool = True          # end a run at its first evaluation with J >= J* (N* is unchanged)
    fixed_lr: bool = False               # add the fixed-LR control (eta0, no rule) at the largest B_train
    b_gen: tuple[int, ...] = ()          # stage-2 B_gen ladder multiples of B_train; () = auto (1, 2, 4, 8)
    explicit_b_gen: bool = False         # b_gen holds absolute B_gen values, not multiples
    plateau_delta: float = 0.1           # q plateau: smallest B_gen with q >= (1 - delta) * q_max
    kv_bytes: int = 0                    # emulated KV capacity in bytes (sets gen.num_kv_blocks); 0 = engine's
    probe_updates: int = 12              # updates per stage-2 throughput probe
    probe_skip: int = 2                  # leading probe updates left out of q (partial rollouts filling up)
    recheck: int = 1                     # survivors whose async B_gen is re-checked for J (best predicted first)
    confirm_seeds: int = 16              # cap on the confirmation's fresh seed pairs (sequential); 0 = none
    min_effect: float = 0.1              # the confirmation stops once its interval lies within 1 +- this
    budget_s: float = 0.0                # stop starting runs after this many seconds; 0 = no limit
    clock: str = "auto"                  # t_gen / t_train as wall | cpu (process CPU time) seconds;
                                         # auto = cpu when the job runs on the CPU, else wall
    cost_table: str = ""                 # a CostTable JSON: T re-costed from each run's trace (tune/clock.py)
    threads: int = 1                     # torch threads every run uses (fixed, recorded)
    workers: int = 1                     # runs at once, each in its own process with `threads` threads
    retune_eps: float = 0.1              # stage 1: retune the LR of a candidate with r_N > 1 + eps
    retune: bool = True                  # run the LR bracket x{1/sqrt2, sqrt2} for such candidates

    def __post_init__(self):
        if not 0 < self.target_j:
            raise ValueError(f"target_j must be > 0, got {self.target_j}")
        if not self.b_train or any(b < 1 for b in self.b_train):
            raise ValueError(f"b_train must list positive batch sizes, got {self.b_train}")
        if not self.seeds:
            raise ValueError("seeds must name at least one seed")
        if not 0 < self.plateau_delta < 1:
            raise ValueError(f"plateau_delta must be in (0, 1), got {self.plateau_delta}")
        if self.probe_updates <= self.probe_skip:
            raise ValueError(f"probe_updates ({self.probe_updates}) must exceed probe_skip ({self.probe_skip})")
        if self.clock not in ("auto", "wall", "cpu"):
            raise ValueError(f"clock must be auto|wall|cpu, got {self.clock!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not 0 < self.min_effect < 1:
            raise ValueError(f"min_effect must be in (0, 1), got {self.min_effect}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.retune_eps < 0:
            raise ValueError(f"retune_eps must be >= 0, got {self.retune_eps}")
        if self.recheck < 0 or self.confirm_seeds < 0 or self.kv_bytes < 0 or self.budget_s < 0:
            raise ValueError("recheck, confirm_seeds, kv_bytes and budget_s must be >= 0")
        train = self.job.get("train", {})
        for key in ("ppo_epochs", "mini_batches"):
            if train.get(key, 1) != 1:
                raise ValueError(f"tune: the job sets train.{key} = {train[key]}, but the tuner's accounting "
                                 "(docs/METHOD.md: the sqrt LR rule, r_N, N per update) assumes ONE optimizer update per "
                                 f"rollout batch; tune the job with train.{key} = 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPlan:
    """One training run to execute: the job with a typed change to its plan (PlanChange)."""

    name: str                            # unique directory name under OUT/runs
    stage: str                           # stage1 | control | probe | recheck | confirm
    label: str                           # configuration label shared by its seeds, e.g. "128", "512 fixed"
    seed: int
    change: PlanChange                   # what differs from the job: batch, B_gen, LR rule, KV pool, length
    target_j: float | None               # stop at the first evaluation reaching it; None = run all updates

    @property
    def overrides(self) -> tuple[tuple[str, object], ...]:
        """The change as (section.key, value) pairs (what tune_run.json and chosen.toml show)."""
        return self.change.overrides()


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineFacts:
    """The rollout engine a run built: what its KV cache can really hold."""

    num_kv_blocks: int                   # blocks in the pool (the null block not counted)
    block_size: int                      # P tokens per block
    max_model_len: int                   # S: longest prompt + max_tokens + 1
    block_bytes: int                     # bytes of one block over all layers, K and V
    device: str                          # cpu | cuda


@dataclass(frozen=True, slots=True, kw_only=True)
class RunCurve:
    """One finished run, read from its metric records."""

    name: str
    label: str
    stage: str
    seed: int
    b_train: int
    b_gen: int
    lr: float                            # eta actually used (the rule applied)
    lr_rule: str
    eval_n: tuple[float, ...]            # [E] N at each evaluation, the first at N = 0
    eval_j: tuple[float, ...]            # [E] J there
    eval_t: tuple[float, ...]            # [E] cumulative t_gen + t_train (s) there
    update_n: tuple[float, ...]          # [U] N after each update
    update_t: tuple[float, ...]          # [U] cumulative t_gen + t_train after each update
    update_t_gen: tuple[float, ...]      # [U] t_gen of each update
    grad_norm: tuple[float, ...]         # [U] actor grad norm of each update (before clipping)
    policy_lag: tuple[float, ...]        # [U] mean policy lag of each update's responses
    stopped_at_target: bool              # the run ended early at J >= J*
    wall_s: float = 0.0                  # whole run incl. warm start and evaluation (0 when unknown)
    cpu_s: float = 0.0                   # process CPU time of the run; cpu_s / wall_s < threads: contention
    clock: str = "wall"                  # what t_gen / t_train (and so T and q) measure: wall | cpu seconds
    load: tuple[float, ...] = ()         # 1-minute load average at start and end (noise context)
    engine: EngineFacts | None = None    # the rollout engine's KV capacity (None when read from a user's run)
    threads: int = 0                     # torch threads the run used (0 when unknown)
    max_lag: int = 1                     # gen.max_lag the run used
    update_b_act: tuple[float, ...] = ()     # [U] mean sequences per decode step of each update's rollout
    update_gen_tokens: tuple[float, ...] = ()  # [U] tokens decoded for each update
    update_resp_len: tuple[float, ...] = ()  # [U] mean response length of the trained responses
    update_stale: tuple[tuple[int, int], ...] = ()  # [U] (requests aborted in flight, groups dropped) for lag


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetHit:
    """Where one run reached J* (all None when it did not within its budget: censored, N* > N_max)."""

    reached: bool
    n_star: float | None                 # N* where the monotone (isotonic) fit of J crosses J*
    t_star: float | None                 # T: the run's clock at N*
    k_star: float | None                 # K* = N* / B_train (updates, fractional)


@dataclass(frozen=True, slots=True, kw_only=True)
class CandidateStats:
    """One configuration over its seeds: N*, T and q with their spread."""

    label: str
    stage: str
    b_train: int
    b_gen: int
    lr: float
    lr_rule: str
    seeds: tuple[int, ...]               # [K]
    hits: tuple[TargetHit, ...]          # [K] per seed
    n_budget: float                      # largest N any seed ran (the budget when J* is missed)
    n_ran: tuple[float, ...] = ()        # [K] N each seed's run reached: a miss is censored there (N* > n_ran)
    grad_norm: tuple[float, ...]         # [K] mean actor grad norm per seed over the common window
    q_run: tuple[float, ...]             # [K] N/T over each whole run
    retuned: str = ""                    # "" or how the LR bracket chose this candidate's LR

    @property
    def reached(self) -> int:
        return sum(h.reached for h in self.hits)

    @property
    def all_reached(self) -> bool:
        return self.reached == len(self.hits)

    def censored_n(self, i: int) -> float:
        """Seed i's N*, or where its run stopped when it missed J* (a lower bound: N* > that)."""
        h = self.hits[i]
        if h.reached:
            return h.n_star
        return self.n_ran[i] if self.n_ran else self.n_budget


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage1Result:
    """Sample-matched curves for every candidate B_train (and the fixed-LR control)."""

    reference: str                       # label of the reference configuration (B0)
    b0: int
    eta0: float
    n_max: int
    eval_every: int
    candidates: tuple[CandidateStats, ...]
    curves: tuple[RunCurve, ...]
    grad_window: float                   # grad norms averaged over updates with N <= this
    lr_scales: tuple[tuple[int, float], ...] = ()  # (B_train, LR factor the retune kept) where not x1


@dataclass(frozen=True, slots=True, kw_only=True)
class GenPoint:
    """End-to-end throughput at one B_gen, measured over the same update window."""

    b_gen: int
    q: float                             # responses / s over the window (t_gen + t_train), mean of the repeats
    q_gen: float                         # responses / s of generation alone
    lag_mean: float                      # mean policy lag of the window's responses
    source: str                          # run name(s) the window came from
    q_reps: tuple[float, ...] = ()       # q of each repeated probe, in the order they ran
    spread: float = 0.0                  # (max - min) / mean of q_reps
    max_lag: int = 1                     # gen.max_lag the probes ran with (the lag B_gen implies)
    q_free: float = 0.0                  # q if generation cost nothing: responses / t_train
    gen_share: float = 0.0               # t_gen / (t_gen + t_train)
    b_act: float = 0.0                   # mean sequences per decode step
    decode_steps: float = 0.0            # decode steps per rollout (gen tokens / B_act, per update)
    resp_len: float = 0.0                # mean response length (tokens)
    stale_aborted: int = 0               # requests aborted in flight for lag, over the window
    stale_dropped: int = 0               # finished groups dropped for lag, over the window


@dataclass(frozen=True, slots=True, kw_only=True)
class GenSweep:
    """Stage 2 for one B_train: q against B_gen up to the plateau or B_KV."""

    b_train: int
    label: str
    points: tuple[GenPoint, ...]         # in ladder order, the first at B_gen = B_train
    b_kv: int                            # KV feasibility limit in sequences (0 = none known)
    b_kv_source: str
    critical_b_gen: int                  # smallest B_gen with q >= (1 - delta) * max q
    plateau: bool                        # two successive points fell below (1 - delta) q_max
    stop_reason: str                     # plateau | B_KV | ladder end | budget | pruned: ...
    verdict: str = ""                    # gain | inconclusive (gain < 2x the repeat spread) | no gain


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage2Result:
    """The B_gen sweeps and the J re-check of the best async configurations."""

    sweeps: tuple[GenSweep, ...]
    rechecks: tuple[CandidateStats, ...]  # async configurations re-run on every seed
    recheck_curves: tuple[RunCurve, ...]
    b_kv: int                            # KV feasibility limit in sequences (0 = none known)
    kv_blocks: int                       # gen.num_kv_blocks set under --kv-bytes (0 = the engine's own)


@dataclass(frozen=True, slots=True, kw_only=True)
class TableRow:
    """A Table-1 row: one configuration against the reference, from per-seed means."""

    label: str
    stage: str
    b_train: int
    b_gen: int
    lr: float
    reached: str                         # "k/K" seeds that reached J*
    k_star: float | None                 # mean K*
    n_star: float | None                 # mean N* over reaching seeds
    n_star_sd: float | None
    t: float | None                      # mean T over reaching seeds
    t_sd: float | None
    r_n: float | None                    # mean N* / mean N*_ref over the seeds where both reached J*
    r_n_lower: float | None              # when some seeds missed J*: r_N with their N* set to the budget
                                         # (a lower bound), over the seeds where the reference reached
    r_n_range: tuple[float, float] | None  # min, max of the per-seed ratios N*_s / N*_ref,s
    t_norm_range: tuple[float, float] | None  # min, max of the per-seed T_s / T_ref,s (same-seed runs ran
                                         # close in time: these pairs see similar machine load)
    q_ratio: float | None                # q / q_ref with q = N*/T, over the same seeds as r_n
    t_norm: float | None                 # T / T_ref, over the same seeds as r_n
    wins: bool | None                    # q/q_ref > r_N
    eligible: bool                       # may be chosen: every seed reached J* and it is not a control
    r_n_ci: dict | None = None           # stats.Interval of N*_s / N*_ref,s over seeds both reached
    q_ci: dict | None = None             # the same for q_s / q_ref,s
    t_ci: dict | None = None             # the same for T_s / T_ref,s
    censored: int = 0                    # seeds that missed J* (N* > N_max, recorded at the budget)
    why: str = ""                        # why the row was not chosen (pruned, lost, censored, ...)


@dataclass(frozen=True, slots=True, kw_only=True)
class Confirmation:
    """Chosen configuration against a baseline (the best coupled one, else the job's own) on fresh
    seeds: time to J*."""

    chosen: str
    default: str
    seeds: tuple[int, ...]
    t_chosen: tuple[float | None, ...]   # [K] T per seed (None: J* not reached)
    t_default: tuple[float | None, ...]
    ratio: tuple[float, ...]             # per seed T_chosen / T_default, where both reached
    ratio_of_means: float | None
    interval: dict | None = None         # stats.Interval of the per-seed ratios (paired log ratios) as a dict
    t_chosen_end: tuple[float, ...] = ()  # [K] each chosen run's T at its last update (a censored run's bound)
    t_default_end: tuple[float, ...] = ()
    faster: tuple[bool | None, ...] = ()  # [K] chosen reached J* sooner (None: order unknown, both missed)
    sign_p: float | None = None          # two-sided sign test over the seeds whose order is known
    method: str = ""                     # how the interval was made (stats.CS_METHOD: a confidence sequence)
    stop_reason: str = ""                # why no further pair was added (decisive, below min effect, cap, budget)


@dataclass(frozen=True, slots=True, kw_only=True)
class TuneResult:
    """Everything `rlengine tune` measured and decided."""

    spec: TuneSpec
    stage1: Stage1Result
    stage2: Stage2Result
    rows: tuple[TableRow, ...]
    chosen: str                          # label of the chosen row ("" when nothing reached J*)
    chosen_overrides: tuple[tuple[str, object], ...]
    confirmation: Confirmation | None
    confirm_curves: tuple[RunCurve, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)   # not reached, no plateau, budget, pruning
    wall_s: float = 0.0
    header: dict = field(default_factory=dict)  # threads, load, clock, host: the conditions of the run
    chosen_lr: float = 0.0               # the LR the chosen configuration ran with


@dataclass(frozen=True, slots=True, kw_only=True)
class RunsReport:
    """`rlengine report`: the same accounting over run directories that already exist."""

    target_j: float
    reference: str                       # label of the reference configuration
    candidates: tuple[CandidateStats, ...]
    curves: tuple[RunCurve, ...]
    rows: tuple[TableRow, ...]
    sweeps: tuple[GenSweep, ...]         # whole-run q against B_gen, per B_train run at several B_gen
    chosen: str                          # the row maximising q / r_N ("" when none is eligible)
    grad_window: float                   # grad norms averaged over updates with N <= this
    notes: tuple[str, ...] = ()
    clock: dict = field(default_factory=dict)  # the device clock's summary (tune/clock.py); {}: the runs' own
