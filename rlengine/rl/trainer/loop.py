"""Trainer: the RL loop of `rlengine train` — collect, update, evaluate, record, checkpoint.

One process, one model: the engine (LLM) decodes with the learner's parameters, and an
optimizer step is visible at the next decode step with no copy. The job's parts are built by
parts.py; each update boundary appends one record (record.py, verl_metrics.py) to
RUN_DIR/metrics.jsonl (run_outputs.py also writes samples.jsonl, TensorBoard files and wandb; trace_file.py
the step trace RUN_DIR/trace.jsonl that the device clock re-costs) and
one line to the console (progress.py, which also reports the set-up phases). Evaluation
(rollout/evaluation.py) uses a second LLM over the SAME module, so in-flight partial rollouts of
the training engine are never disturbed. Rewards run through one reward runner per job
(data/reward_pool.py: in this process or a spawned pool), closed when run() returns or raises.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from rlengine.rl.algo.overlong import shape_overlong
from rlengine.rl.algo.schedule import lr_factor
from rlengine.model.config import ConfigError
from rlengine.rl.config import TrainConfig
from rlengine.rl.data.tasks import assign_token_credits
from rlengine.rl.data.warmstart import cached_warmstart, check_cache_dir, format_warmstart, warmstart_key
from rlengine.rl.trainer.adapter_ckpt import attach_run_lora
from rlengine.rl.distributed import Dist, init_from_env
from rlengine.rl.learner.batching import estimate_batch
from rlengine.rl.rollout.collector import CollectStats
from rlengine.rl.trainer.checkpoint import resume_run, save_run
from rlengine.rl.trainer.graphs import EngineGraphs
from rlengine.rl.trainer.parts import build_learner, build_parts
from rlengine.rl.trainer.progress import RunConsole
from rlengine.rl.trainer.record import UpdateTimes, boundary_since, engine_mark, update_record, write_telemetry
from rlengine.plan.specs import saved_micro_batch
from rlengine.rl.trainer.run_dir import keep_metrics_through, prepare_run_dir, start_new_run, write_plan
from rlengine.rl.trainer.run_outputs import RunOutputs, write_samples
from rlengine.rl.trainer.signals import StopOnSignal
from rlengine.rl.trainer.trace_file import TraceFile, update_trace
from rlengine.rl.trainer.verl_metrics import StepWall, advantage_sums, timing_fields
from rlengine.telemetry.nvml import NvmlSampler
from rlengine.telemetry.profiler import ProfileWindow, step_profiler
from rlengine.telemetry.timers import PhaseTimer


def train_batch(groups, t, task, tok):
    """The update's TrainBatch under train.algo's estimator: outcome advantages per response (or per
    token with train.credit = "token"), or a critic's (every response; the learner runs GAE)."""
    token_credit = t.credit == "token"
    if token_credit and any(not g.token_credits for g in groups):  # the collector sets them
        assign_token_credits(groups, task, tok)
    return estimate_batch(groups, t.algorithm.estimator, t, token_credit=token_credit)  # train.adv_estimator applied


def eval_fields(metrics: dict) -> dict:
    """An evaluation's fields of a metrics record, but J (the caller sets it)."""
    return {k: v for k, v in metrics.items() if k != "J"}


def eval_due(cfg: TrainConfig, update: int, n_before: int, n: int) -> bool:
    """After an update: every eval.every updates, or each time N crosses a multiple of
    eval.every_responses (the same N grid for every B_train), and at the end."""
    e = cfg.eval
    if update == cfg.train.updates:
        return True
    if e.every_responses > 0:
        return n // e.every_responses > n_before // e.every_responses
    return update % e.every == 0


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool = False, resume_from: str | Path | None = None,
                 dist: Dist | None = None, profile: str | Path | None = None, profile_window: str = "1:2"):
        """resume / resume_from: continue from the latest checkpoint of `resume_from` (default: run.out_dir);
        metrics go to run.out_dir either way. dist: this rank (default: from torchrun's environment).
        profile: a directory for a torch.profiler trace of the RL updates in profile_window (START:STOP)."""
        self.cfg, self.profile = cfg, (profile, ProfileWindow.parse(profile_window))  # (out dir, window)
        self.run_dir = Path(cfg.run_dir)
        asked = Path(resume_from) if resume_from is not None else (self.run_dir if resume else None)
        # never into another run's directory (checked before the first collective: no rank wrote yet);
        # None: a new run, or a resumed one stopped before its first checkpoint, which starts over
        self.resume_dir = prepare_run_dir(self.run_dir, asked, cfg.run.overwrite)
        if cfg.run.warmstart_cache and self.resume_dir is None and cfg.warmstart.steps:
            check_cache_dir(cfg.run.warmstart_cache)  # a file, read-only: one line before anything is written
        self.dist = dist if dist is not None else init_from_env(cfg.run.dist_timeout_s, cfg.run.save_timeout_s)
        self.dist.check_same("config", cfg.to_dict())
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        t = cfg.train
        self.console = RunConsole(enabled=cfg.run.progress and self.dist.is_main,
                                  filtering=t.dynamic_sampling and t.algorithm.group_relative)
        with self.console.status(f"building the job: model {cfg.model.name}, engines, rewards"):
            pinned = saved_micro_batch(self.resume_dir) if self.resume_dir is not None else None
            self.parts = p = build_parts(cfg, self.dist, pinned_micro_batch=pinned)
        self.model, self.tok, self.task, self.llm, self.eval_llm = p.model, p.tok, p.task, p.llm, p.eval_llm
        self.sampler, self.rewards, self.collector = p.sampler, p.rewards, p.collector
        self.plan, self.memory_plan = p.plan, p.plan.memory  # what was resolved (RUN_DIR/plan.json)
        self.outputs = RunOutputs(self.run_dir, tensorboard=cfg.run.tensorboard, write=self.dist.is_main,
                                  wandb=cfg.to_dict() if cfg.run.wandb else None, wandb_project=cfg.run.wandb_project)
        self.update, self.N, self.history, self._saved = 0, 0, [], -1  # _saved: update last checkpointed
        self.trace_file = TraceFile(self.run_dir, write=self.dist.is_main)  # the device clock's step trace
        self._pending = None  # the checkpoint save still being written (run.async_checkpoint)
        self.telemetry = NvmlSampler.for_device(self.model.device)  # the GPU this rank uses, if any
        self.timer = PhaseTimer(self.model.device)  # t_gen / t_train; syncs only at phase ends
        self.llm.phase_listener = self.telemetry
        if self.resume_dir is None and self.dist.is_main:
            start_new_run(self.run_dir, cfg, self.outputs)
        if self.dist.is_main:
            write_plan(self.run_dir, self.plan, announce=cfg.run.progress)
        w = cfg.warmstart
        self.warmstart_losses = []
        if self.resume_dir is None and w.steps:
            with self.console.status(f"format warm start: {w.steps} supervised steps"):
                def warm():
                    return format_warmstart(self.model, self.tok, self.task, steps=w.steps, lr=w.lr, batch=w.batch,
                                            seed=cfg.run.seed, encode_prompt=p.encode)
                if cfg.run.warmstart_cache:
                    key = warmstart_key(cfg.to_dict(), threads=torch.get_num_threads(), device=str(self.model.device))
                    self.warmstart_losses, _ = cached_warmstart(self.model, cfg.run.warmstart_cache, key, warm)
                else:
                    self.warmstart_losses = warm()
        # LoRA (model.lora_*): adapters on the frozen base, the model as the warm start left it
        attach_run_lora(self.model, cfg, self.run_dir, warm_started=bool(w.steps),
                        resumed=self.resume_dir is not None, write=self.dist.is_main)
        # Built after the warm start: the KL reference and the PPO critic start from the policy at
        # update 0, not from the random initialisation (on resume, the checkpoint restores both).
        slow = [f"resuming from {self.resume_dir}"] * (self.resume_dir is not None) + \
            ["capturing decode CUDA graphs"] * (self.model.device.type == "cuda")
        with self.console.status(", ".join(slow)) if slow else contextlib.nullcontext():
            self.learner = build_learner(self.plan.learner, self.model, self.dist)
            if self.resume_dir is not None:
                self._resume()
            # GPU: capture decode graphs now, not inside timed steps, on the parameters the engine reads
            self.graphs = EngineGraphs(self.model, (self.llm, self.eval_llm))
            with self.dist.unsharded(self.model):
                self.graphs.refresh()

    def evaluate(self) -> float:
        """J: the primary eval set's mean@k; every set's mean@k and pass@k go to self.eval_metrics.
        Eval prompt i runs on rank i mod K with seed request_seed(run seed + 1, i)."""
        with self.dist.unsharded(self.model):
            self.graphs.refresh()
            self.eval_metrics = self.parts.evaluator.run()
        return self.eval_metrics["J"]

    def train_step(self) -> dict:
        """One update: collect B_train responses, shape, batch, one learner step; returns its record."""
        t, r, llm, dist = self.cfg.train, self.plan.rollout, self.llm, self.dist
        stats, mark = CollectStats(), engine_mark(llm)
        self.timer.reset()
        with self.timer.phase("gen"), dist.unsharded(self.model):  # FSDP: decode from full weights
            self.graphs.refresh()
            groups = self.collector.collect(stats)
        overlong, penalty = shape_overlong(groups, r.overlong, max_tokens=r.max_tokens, buffer=r.overlong_buffer)
        self.learner.set_lr_factor(lr_factor(self.update, schedule=t.lr_schedule, warmup=t.warmup_updates,
                                             total=t.updates, min_ratio=t.min_lr_ratio))
        batch = train_batch(groups, t, self.task, self.tok).to(self.model.device)
        critic_only = self.learner.critic is not None and self.update < t.critic_warmup
        self.learner.steps.clear()
        with self.timer.phase("train"):
            m = self.learner.step(batch, critic_only=critic_only, phases=self.telemetry)
        advantages = advantage_sums(batch.advantages, batch.loss_mask > 0)  # PPO whitened them in the step
        self.telemetry.set_phase("idle")
        rank_times = [self.timer.total("gen"), self.timer.total("train")]
        times = UpdateTimes(*rank_times, *dist.all_max(rank_times))  # the ranks' slowest gates the update
        if not m["skipped"] and not critic_only:
            llm.weight_version += 1
        self.N += 0 if critic_only else r.b_train
        self.update += 1
        boundary = boundary_since(llm, mark, responses=r.b_train, times=times)
        self.trace_file.write(update_trace(llm.trace[mark[0]:], self.learner.steps, update=self.update, n=self.N,
                                           t_gen=times.t_gen, t_train=times.t_train, critic_only=critic_only))
        consumed = llm.weight_version - (0 if m["skipped"] or critic_only else 1)
        if self.cfg.run.samples_every and self.update % self.cfg.run.samples_every == 0:
            write_samples(self.outputs, groups, batch, self.tok, update=self.update, n=self.N, dist=dist)
        if m["skipped"] and dist.is_main:
            print(f"update {self.update}: non-finite loss or gradient, update skipped (weights unchanged)")
        return update_record(update=self.update, n=self.N, critic_only=critic_only, b_train=r.b_train, stats=stats,
                             m=m, times=times, boundary=boundary, groups=groups, num_seqs=batch.num_seqs,
                             consumed=consumed, overlong=overlong, penalty=penalty, soft_overlong=r.overlong == "soft",
                             lr=self.learner.opt.param_groups[0]["lr"], dist=dist, advantages=advantages,
                             has_critic=self.learner.critic is not None)

    def run(self, stop_after: int | None = None, stop_when=None) -> list[dict]:
        """Train until train.updates (or `stop_after` updates, for tests); checkpoint at the end.

        stop_when(record) -> bool, checked after each logged update, ends the run early (e.g. the
        tuner stops a curve at its first evaluation with J >= J*); self.stopped_early says so.
        A SIGINT / SIGTERM ends it at the next update boundary, checkpointed (self.interrupted).
        """
        self.stopped_early = self.interrupted = False
        last = min(self.cfg.train.updates, stop_after) if stop_after else self.cfg.train.updates
        try:
            with StopOnSignal(announce=self.dist.is_main) as stop:
                if self.update == 0:
                    with self.console.status("evaluating J at N = 0"):
                        j = self.evaluate()
                    self._log({"update": 0, "N": 0, "J": j, **eval_fields(self.eval_metrics)})
                self._loop(last, stop_when, stop)
                # inside the handler: a signal now lets the last save finish (a second one exits at once)
                if self._saved != self.update:  # the last update is saved once; a finished run, not again
                    self.checkpoint()
                self.wait_for_checkpoint()
                # after the checkpoint: a telemetry file that cannot be written (a full disk) costs no update
                write_telemetry(self.telemetry, self.history, b_train=self.cfg.train.b_train, dist=self.dist,
                                run_dir=self.run_dir, gpu=self.model.device.type == "cuda")
        finally:  # a reward pool's workers never outlive the run, whatever ended it
            self.parts.close()
            self.outputs.close()
        return self.history

    def _loop(self, last: int, stop_when, stop) -> None:
        cfg, (out, window) = self.cfg, self.profile
        profiler = step_profiler(out if self.dist.is_main else None, name="train", window=window,
                                 device=self.model.device, ranges=[self.llm.ranges, self.learner.ranges])
        self.telemetry.start()
        with profiler, self.console.updates(cfg.train.updates, start=self.update) as console:
            while self.update < last:
                record = self._update_and_after()
                fault = self._log(record, defer=True)
                console.advance(record)
                # every rank stops at the same update, and ends alike when rank 0 could not write its line
                stopping, faulted = self.dist.all_max([float(stop.requested), float(fault is not None)])
                if faulted:  # the record is safe in the update's checkpoint, when one was due
                    raise fault or ConfigError("rank 0 could not write metrics.jsonl (its error says why)")
                if stop_when is not None and stop_when(record):
                    self.stopped_early = True
                    break
                if stopping:
                    self.interrupted = True
                    break
                profiler.step()  # one profiler step = one RL update (collect, update, eval, log)
        if profiler.trace_path:
            print(f"profile of updates {window.start}..{window.stop - 1}: {profiler.trace_path} {profiler.note}")
        self.telemetry.stop()

    def _update_and_after(self) -> dict:
        """One update, its evaluation when due and its periodic checkpoint (before the record is logged,
        so the record holds their times: timing_s/*); returns the record."""
        cfg, start, n_before = self.cfg, time.perf_counter(), self.N
        record = self.train_step()
        testing = save = 0.0
        if eval_due(cfg, self.update, n_before, self.N):
            t0 = time.perf_counter()
            record["J"] = self.evaluate()
            record.update(eval_fields(self.eval_metrics))
            testing = time.perf_counter() - t0
        if cfg.run.checkpoint_every and self.update % cfg.run.checkpoint_every == 0:
            t0 = time.perf_counter()
            self.checkpoint(record=dict(record))  # the record rides in the checkpoint until its line is written
            save = time.perf_counter() - t0
        wall = StepWall(testing=testing, save_checkpoint=save, step=time.perf_counter() - start)
        record.update(timing_fields(record, wall, b_train=cfg.train.b_train, world=self.dist.world,
                                    device=self.model.device))
        return record

    def _log(self, record: dict, defer: bool = False) -> ConfigError | None:
        """Append `record` to the history and the run's outputs; a write that fails (a full disk) raises,
        or with `defer` is returned, so that every rank can learn of it first."""
        self.history.append(record)
        try:
            self.outputs.log(record)
        except ConfigError as exc:
            if not defer:
                raise
            return exc
        return None

    def checkpoint(self, record: dict | None = None) -> Path | None:
        """Save this update (run.async_checkpoint: start saving it; returns None); the save before it
        is finished first. record: this update's metrics record, not yet in metrics.jsonl."""
        self.wait_for_checkpoint()
        self._saved, asynchronous = self.update, self.cfg.run.async_checkpoint
        saved = save_run(self.run_dir, update=self.update, n=self.N, model=self.model, learner=self.learner,
                         llm=self.llm, collector=self.collector, sampler=self.sampler, dist=self.dist,
                         keep=self.cfg.run.keep_checkpoints, asynchronous=asynchronous, record=record)
        if asynchronous:
            self._pending = saved
            return None
        return saved

    def wait_for_checkpoint(self) -> Path | None:
        """Block until the save in flight is on disk on every rank; returns its directory (rank 0)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return pending.settle()  # every rank: raises CheckpointError on all of them when any part failed

    def _resume(self) -> None:
        self.update, self.N = resume_run(self.resume_dir, model=self.model, learner=self.learner, llm=self.llm,
                                         collector=self.collector, sampler=self.sampler, dist=self.dist)
        if self.resume_dir.resolve() == self.run_dir.resolve():
            self._saved = self.update  # already on disk here: a finished run resumed rewrites nothing
        self.history = keep_metrics_through(self.resume_dir, self.run_dir, self.update, self.cfg, self.outputs,
                                            self.dist)
