"""Executes one RunPlan with rlengine's Trainer: OUT/runs/NAME holds its config, metrics and summary.

The job config is a dict (TrainConfig.to_dict()); a plan's overrides replace single keys and the
result is validated like any `rlengine train` config. With a target J*, the run ends at the first
evaluation reaching it (N* and T are then known; the rest of the budget would not change them).
That stop is the Trainer's own hook, Trainer.run(stop_when=...), checked after each logged update.
A finished run writes
tune_run.json last, so an interrupted tune leaves either a finished run or a directory to redo:
with resume=True finished runs whose config matches are read back instead of rerun. Every run
uses the same fixed torch thread count (set before the Trainer is built, recorded in tune_run.json):
throughput figures of runs with different thread counts would not compare.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from rlengine.config import ConfigError
from rlengine.rl.config import TrainConfig
from rlengine.tune.curves import curve_from_records, read_run
from rlengine.tune.types import EngineFacts, RunCurve, RunPlan


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


def plan_config(job: dict, plan: RunPlan, run_dir: Path) -> TrainConfig:
    """The validated TrainConfig of `plan`: the job dict with the plan's overrides and its directory."""
    d = copy.deepcopy(job)
    for key, value in plan.overrides:
        section, name = key.split(".", 1)
        if section not in d or name not in d[section]:
            raise ConfigError(f"tune: override {key} names no config field")
        d[section][name] = value
    d["run"].update(out_dir=str(run_dir), seed=plan.seed, progress=False, checkpoint_every=0)
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
    if "run" in a:
        a = {**a, "run": {**a["run"], "out_dir": b["run"]["out_dir"]}}
    return a == b and saved.get("clock", "wall") == clock


class TrainerRunner:
    """Callable RunPlan -> RunCurve (None when the time budget is spent), one run at a time."""

    def __init__(self, job: dict, out_dir: str | Path, *, resume: bool = False, budget_s: float = 0.0,
                 clock: str = "auto", threads: int = 1, log: Callable[[str], None] = print):
        if threads < 1:
            raise ConfigError(f"tune: threads must be >= 1, got {threads}")
        self.job, self.root, self.threads = job, Path(out_dir) / "runs", threads
        self.clock = resolve_clock(clock, job)
        self.resume, self.budget_s, self.log = resume, budget_s, log
        self.start = time.perf_counter()
        self.done = 0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def out_of_budget(self) -> bool:
        return self.budget_s > 0 and self.elapsed > self.budget_s

    def __call__(self, plan: RunPlan) -> RunCurve | None:
        run_dir = self.root / plan.name
        cfg = plan_config(self.job, plan, run_dir)
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
            return read_run(run_dir)
        if self.out_of_budget:
            return None
        if run_dir.exists():  # interrupted earlier: start it again from nothing
            shutil.rmtree(run_dir)
        return self._execute(plan, cfg, run_dir)

    def _execute(self, plan: RunPlan, cfg: TrainConfig, run_dir: Path) -> RunCurve:
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
        stopped = trainer.stopped_early
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        load = (load0, _load())
        engine = engine_facts(trainer.llm)
        curve = curve_from_records(trainer.history, cfg.to_dict(), name=plan.name, label=plan.label,
                                   stage=plan.stage, stopped_at_target=stopped, wall_s=wall, cpu_s=cpu,
                                   load=load, engine=engine, clock=self.clock, threads=self.threads)
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
        last_j = curve.eval_j[-1] if curve.eval_j else float("nan")
        reached = " (reached J*)" if stopped else ""
        self.log(f"[{plan.stage}] {plan.label} seed {plan.seed}: N={curve.update_n[-1]:.0f} J={last_j:.3f} "
                 f"T={curve.update_t[-1]:.1f}s{reached}; {wall:.0f}s wall ({cpu:.0f}s CPU), "
                 f"tune at {self.elapsed:.0f}s, load {load[0]:.1f}->{load[1]:.1f}")
        return curve
