"""Executes one RunPlan with rlengine's Trainer: OUT/runs/NAME holds its config, metrics and summary.

The job config is a dict (TrainConfig.to_dict()); a plan's change (PlanChange) sets single keys and the
result is validated like any `rlengine train` config. With a target J*, the run ends at the first
evaluation reaching it (N* and T are then known; the rest of the budget would not change them).
That stop is the Trainer's own hook, Trainer.run(stop_when=...), checked after each logged update.
A finished run writes
tune_run.json last, so an interrupted tune leaves either a finished run or a directory to redo:
with resume=True finished runs whose config matches are read back instead of rerun. Every run
uses the same fixed torch thread count (set before the Trainer is built, recorded in tune_run.json):
throughput figures of runs with different thread counts would not compare.

With workers > 1, TrainerRunner.map runs a list of plans in that many worker processes at once
(`python -m rlengine.tune.worker`, one run each), so a 2-core machine runs two one-thread curves
side by side. Stage code hands it whole lists (run_plans): a stage's seeds, a retune bracket, a
confirmation's interleaved pairs. The two runs of a pair then share the machine's caches and
memory bandwidth at the same time, so neither is measured under conditions the other missed.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from rlengine.model.config import ConfigError
from rlengine.rl.config import TrainConfig
from rlengine.tune.curves import curve_from_records, read_run
from rlengine.tune.stage_records import EngineFacts, RunCurve, RunPlan


def resolve_clock(clock: str, job: dict) -> str:
    """'auto' -> 'cpu' when the job runs on the CPU (model.device cpu, or auto without CUDA), else 'wall'."""
    if clock != "auto":
        return clock
    import torch

    device = job["model"]["device"]
    return "cpu" if device == "cpu" or (device == "auto" and not torch.cuda.is_available()) else "wall"


def cpu_phase_timer(device):
    """A PhaseTimer whose phases count process CPU seconds (time.process_time), not wall seconds.

    On a CPU shared with other jobs, wall-clock phases include the time this process waits for a
    core, which follows the others' load, not the configuration; CPU time does not (it still sees
    cache and memory-bandwidth contention). It counts every thread: meant for one compute thread.
    """
    from contextlib import contextmanager

    from rlengine.telemetry.timers import PhaseTimer

    class CpuPhaseTimer(PhaseTimer):
        @contextmanager
        def phase(self, name: str):
            if name in self._open:
                raise RuntimeError(f"PhaseTimer: phase {name!r} is already open")
            self._open.add(name)
            t0 = time.process_time()
            try:
                yield
            finally:
                self._add(name, time.process_time() - t0)
                self._open.discard(name)

    return CpuPhaseTimer(device)


def plan_config(job: dict, plan: RunPlan, run_dir: Path, *, warmstart_cache: str = "") -> TrainConfig:
    """The validated TrainConfig of `plan`: the job with the plan's change (PlanChange) and its directory
    (and run.warmstart_cache: the tune's runs share each seed's warm start, the same bits)."""
    d = plan.change.apply_to_dict(copy.deepcopy(job))
    d["run"].update(out_dir=str(run_dir), seed=plan.seed, progress=False, checkpoint_every=0)
    train = d["train"]
    if train.get("warmup_updates", 0) >= train["updates"]:
        # a run shorter than the job's LR warm-up (a stage-2 probe): the warm-up ends on its last update
        train["warmup_updates"] = train["updates"] - 1
    if warmstart_cache:
        d["run"]["warmstart_cache"] = warmstart_cache
    return TrainConfig.from_dict(d)


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on every platform
        return -1.0


def engine_facts(llm) -> EngineFacts:
    """The rollout engine's real KV capacity (an rlengine.engine.LLM)."""
    cache = llm.kv_cache
    return EngineFacts(num_kv_blocks=cache.num_blocks, block_size=llm.block_size, max_model_len=llm.max_model_len,
                       block_bytes=cache.nbytes // (cache.num_blocks + 1),  # + 1: the null block
                       device=str(llm.device.type))


def _same_run(saved: dict, cfg: TrainConfig, clock: str) -> bool:
    """A finished run's tune_run.json describes `cfg` on `clock` (its directory may have moved)."""
    a, b = saved.get("config") or {}, json.loads(json.dumps(cfg.to_dict()))
    if "run" in a:  # where the run and its warm-start cache lie does not change what it computed
        a = {**a, "run": {**a["run"], "out_dir": b["run"]["out_dir"]}}
        a["run"].pop("warmstart_cache", None)
        b["run"].pop("warmstart_cache", None)
    return a == b and saved.get("clock", "wall") == clock


def parse_workers(text: str, job: dict, threads: int) -> int:
    """`tune --workers`: a count, or auto: two runs side by side when a CPU job has 2 x threads cores
    (a GPU job runs one at a time: runs sharing a device would time each other)."""
    if text != "auto":
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(f"--workers {text}: give a count >= 1 or auto")
        return int(text)
    return 2 if resolve_clock("auto", job) == "cpu" and (os.cpu_count() or 1) >= 2 * threads else 1


def run_plans(runner, plans: Sequence[RunPlan]) -> list[RunCurve | None]:
    """The curves of `plans` in their order: runner.map when the runner has one (it may run several
    at once), else one call per plan (any Callable[[RunPlan], RunCurve | None], as tests pass)."""
    many = getattr(runner, "map", None)
    return many(list(plans)) if many is not None else [runner(p) for p in plans]


class TrainerRunner:
    """Callable RunPlan -> RunCurve (None when the time budget is spent); map(plans) runs a list,
    `workers` of them at once in worker processes."""

    def __init__(self, job: dict, out_dir: str | Path, *, resume: bool = False, budget_s: float = 0.0,
                 clock: str = "auto", threads: int = 1, workers: int = 1, log: Callable[[str], None] = print,
                 device_clock=None):
        """device_clock: a tune.clock.DeviceClock; every curve's T is then its run's trace re-costed on it
        (the runs still time themselves on `clock`, recorded in tune_run.json)."""
        if threads < 1:
            raise ConfigError(f"tune: threads must be >= 1, got {threads}")
        if workers < 1:
            raise ConfigError(f"tune: workers must be >= 1, got {workers}")
        self.job, self.out_dir, self.root, self.threads = job, Path(out_dir), Path(out_dir) / "runs", threads
        self.clock = resolve_clock(clock, job)
        self.resume, self.budget_s, self.log, self.workers = resume, budget_s, log, workers
        self.start = time.perf_counter()
        self.done = 0
        self.python = sys.executable          # the interpreter worker processes run
        self.warmstart_cache = str(self.out_dir / "warmstart")
        self.device_clock = device_clock

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def out_of_budget(self) -> bool:
        return self.budget_s > 0 and self.elapsed > self.budget_s

    def __call__(self, plan: RunPlan) -> RunCurve | None:
        return self.map([plan])[0]

    def map(self, plans: Sequence[RunPlan]) -> list[RunCurve | None]:
        """Run `plans` (finished ones read back under resume; None for those the budget does not
        start), up to `workers` at once; results in the order of `plans`."""
        out: list[RunCurve | None] = [None] * len(plans)
        todo = []
        for i, plan in enumerate(plans):
            run_dir = self.root / plan.name
            cfg = plan_config(self.job, plan, run_dir, warmstart_cache=self.warmstart_cache)
            done = self._finished(plan, cfg, run_dir)
            if done is not None:
                out[i] = done
            else:
                todo.append((i, plan, cfg, run_dir))
        if self.workers == 1:
            for i, plan, cfg, run_dir in todo:
                if self.out_of_budget:
                    break
                out[i] = self.execute(plan, cfg, run_dir)
            return out
        running: list[tuple[int, RunPlan, Path, subprocess.Popen, float]] = []
        while todo or running:
            while todo and len(running) < self.workers and not self.out_of_budget:
                i, plan, cfg, run_dir = todo.pop(0)
                running.append((i, plan, run_dir, self._spawn(plan, run_dir), time.perf_counter()))
            if not running:
                break  # budget spent: what is left is not started
            time.sleep(0.2)
            for item in [r for r in running if r[3].poll() is not None]:
                running.remove(item)
                i, plan, run_dir, proc, t0 = item
                out[i] = self._collect(plan, run_dir, proc, t0)
        return out

    def _finished(self, plan: RunPlan, cfg: TrainConfig, run_dir: Path) -> RunCurve | None:
        """The finished run of `plan` read back (resume), or None after clearing an interrupted one."""
        summary = run_dir / "tune_run.json"
        if summary.is_file():
            saved = json.loads(summary.read_text())
            if not self.resume:
                raise ConfigError(f"tune: {run_dir} already holds a finished run; pass --resume to reuse it "
                                  f"or choose another --out")
            if not _same_run(saved, cfg, self.clock):
                raise ConfigError(f"tune --resume: {run_dir} was run with a different config or clock; "
                                  f"remove it or choose another --out")
            self.log(f"[{plan.stage}] {plan.label} seed {plan.seed}: finished earlier, read from {run_dir}")
            return read_run(run_dir, self.device_clock)
        if run_dir.exists():  # interrupted earlier: start it again from nothing
            shutil.rmtree(run_dir)
        return None

    def _spawn(self, plan: RunPlan, run_dir: Path) -> subprocess.Popen:
        """One worker process for `plan`, its output in OUT/logs/NAME.log."""
        logs = self.out_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        task = logs / f"{plan.name}.json"
        task.write_text(json.dumps({"job": self.job, "plan": dataclasses.asdict(plan), "out_dir": str(self.out_dir),
                                    "clock": self.clock, "threads": self.threads,
                                    "warmstart_cache": self.warmstart_cache, "parent_pid": os.getpid()}))
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        with open(logs / f"{plan.name}.log", "w") as fh:
            return subprocess.Popen([self.python, "-m", "rlengine.tune.worker", str(task)], stdout=fh,
                                    stderr=subprocess.STDOUT, env=env)

    def _collect(self, plan: RunPlan, run_dir: Path, proc: subprocess.Popen, t0: float) -> RunCurve:
        log = self.out_dir / "logs" / f"{plan.name}.log"
        if proc.returncode != 0 or not (run_dir / "tune_run.json").is_file():
            tail = "\n".join(log.read_text().splitlines()[-15:]) if log.is_file() else ""
            raise RuntimeError(f"tune: run {plan.name} failed in its worker (exit {proc.returncode}); "
                               f"its log {log} ends:\n{tail}")
        curve = read_run(run_dir, self.device_clock)
        self.done += 1
        self._report(plan, curve, time.perf_counter() - t0)
        return curve

    def _report(self, plan: RunPlan, curve: RunCurve, wall: float) -> None:
        last_j = curve.eval_j[-1] if curve.eval_j else float("nan")
        reached = " (reached J*)" if curve.stopped_at_target else ""
        load = curve.load or (-1.0, -1.0)
        self.log(f"[{plan.stage}] {plan.label} seed {plan.seed}: N={curve.update_n[-1]:.0f} J={last_j:.3f} "
                 f"T={curve.update_t[-1]:.1f}s{reached}; {wall:.0f}s wall ({curve.cpu_s:.0f}s CPU), "
                 f"tune at {self.elapsed:.0f}s, load {load[0]:.1f}->{load[-1]:.1f}")

    def execute(self, plan: RunPlan, cfg: TrainConfig, run_dir: Path) -> RunCurve:
        import torch

        from rlengine.rl.trainer.loop import Trainer

        torch.set_num_threads(self.threads)
        load0, t0, cpu0 = _load(), time.perf_counter(), time.process_time()
        trainer = Trainer(cfg)
        if self.clock == "cpu":
            trainer.timer = cpu_phase_timer(trainer.model.device)  # read by train_step for t_gen / t_train
        target = plan.target_j
        trainer.run(stop_when=None if target is None else
                    lambda r: r["update"] > 0 and r.get("J") is not None and r["J"] >= target)
        if trainer.interrupted:  # a stop signal: the run is unfinished, so no tune_run.json (--resume redoes it)
            raise KeyboardInterrupt
        stopped = trainer.stopped_early
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        load = (load0, _load())
        engine = engine_facts(trainer.llm)
        records, clock = trainer.history, self.clock
        if self.device_clock is not None:  # T on the device clock: the run's step trace re-costed
            from rlengine.rl.trainer.trace_file import read_trace

            records, clock = self.device_clock.recost(records, read_trace(run_dir), run=str(run_dir)), self.device_clock.label
            self.device_clock.check_model(cfg.model.name, cfg.model.dtype)
        curve = curve_from_records(records, cfg.to_dict(), name=plan.name, label=plan.label,
                                   stage=plan.stage, stopped_at_target=stopped, wall_s=wall, cpu_s=cpu,
                                   load=load, engine=engine, clock=clock, threads=self.threads)
        dist = getattr(trainer, "dist", None)
        if dist is None or dist.is_main:
            meta = {"name": plan.name, "label": plan.label, "stage": plan.stage, "seed": plan.seed,
                    "overrides": [list(kv) for kv in plan.overrides], "target_j": plan.target_j,
                    "stopped_at_target": stopped, "wall_s": wall, "cpu_s": cpu, "clock": self.clock,
                    "threads": self.threads, "load": list(load),
                    "engine": dataclasses.asdict(engine), "config": cfg.to_dict()}
            (run_dir / "tune_run.json").write_text(json.dumps(meta, indent=2))
        del trainer
        gc.collect()
        self.done += 1
        self._report(plan, curve, wall)
        return curve
