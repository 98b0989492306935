"""Trainer: the RL loop of `rlengine train` — collect, update, evaluate, record, checkpoint.

One process, one model: the engine (LLM) decodes with the learner's parameters, and an
optimizer step is visible at the next decode step with no copy. Each update boundary
appends one line to RUN_DIR/metrics.jsonl: N (retained training responses, excluding
critic warm-up), J (held-out mean@k when evaluated), rewards, retained fraction, t_gen,
t_train, q_gen, q, grad norms, clip fraction, entropy, KL, the generator-vs-learner
log-prob difference, policy lag, lr, the over-long fraction and the B_act distribution of the
boundary's decode steps (run_outputs.py also writes samples.jsonl and TensorBoard files).
Evaluation (evaluation.py: named eval sets, mean@k and pass@k) uses a second LLM over the SAME
module (its own small KV cache), so in-flight partial rollouts of the training engine are never
disturbed. Rewards run through one reward runner per job (reward_pool.py: in this process or a
spawned pool), closed when run() returns or raises.
"""

from __future__ import annotations

import dataclasses
import json
import random
import warnings
from pathlib import Path

import torch

from rlengine.analysis.memory_plan import plan_for_config
from rlengine.config import ConfigError
from rlengine.engine import LLM, SamplingParams
from rlengine.model.factory import build_model, default_device, tokenizer_for
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.batching import grpo_batch, ppo_batch
from rlengine.rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from rlengine.rl.config import TrainConfig
from rlengine.rl.learner import Learner
from rlengine.rl.distributed import Dist, init_from_env
from rlengine.rl.evaluation import Evaluator, build_eval_sets
from rlengine.rl.overlong import shape_overlong
from rlengine.rl.prompts import PromptEncoder, check_job_prompts
from rlengine.rl.reward_pool import make_runner
from rlengine.rl.rollout import CollectStats, PrioritySampler, RolloutCollector
from rlengine.rl.run_outputs import RunOutputs, samples_rows
from rlengine.rl.schedule import lr_factor
from rlengine.rl.tasks import Task, build_task
from rlengine.rl.warmstart import format_warmstart
from rlengine.telemetry.nvml import NvmlSampler
from rlengine.telemetry.profiler import ProfileWindow, step_profiler
from rlengine.telemetry.records import build_boundary_record
from rlengine.telemetry.timers import PhaseTimer


def _build_model(cfg: TrainConfig, dist: Dist) -> tuple[Qwen3ForCausalLM, Tokenizer]:
    device = cfg.model.device if cfg.model.device != "auto" else str(default_device())
    if device == "cuda" and dist.enabled:
        device = f"cuda:{dist.local_rank}"  # one device per rank
    moe_impl = cfg.model.moe_impl if cfg.model.moe_impl != "auto" else ("triton" if device == "cuda" else "ref")
    model = build_model(cfg.model.name, dtype=cfg.model.dtype, device=device, moe_impl=moe_impl, seed=cfg.run.seed)
    tok = tokenizer_for(cfg.model.name)
    if tok.eos_token_id is None:
        raise ConfigError(f"model.name {cfg.model.name!r}: the tokenizer has no EOS token (tokenizer_config.json "
                          "eos_token or generation_config.json eos_token_id), so responses could never end")
    if Path(str(cfg.model.name)).is_dir():  # a checkpoint: stop at its own EOS ids and the tokenizer's
        eos = list(dict.fromkeys(model.config.eos_token_ids + list(getattr(tok, "eos_token_ids", None) or [])
                                 + [tok.eos_token_id]))
        model.config.eos_token_id = eos[0] if len(eos) == 1 else eos
    else:  # a preset: the built-in tokenizer's <eos> is the only end
        model.config.eos_token_id = tok.eos_token_id
    return model, tok


def _build_engines(cfg: TrainConfig, model: Qwen3ForCausalLM, task: Task, encode, eval_sets, dist: Dist):
    """The rollout engine and the eval engine (sharing one KV pool) sized for the job's longest prompt,
    after checking every train and eval prompt fits; returns (llm, eval_llm, memory_plan or None)."""
    g = cfg.gen
    check_job_prompts(task, eval_sets if cfg.eval.sets else [], encode,
                      max_position_embeddings=model.config.max_position_embeddings, max_tokens=g.max_tokens)
    eval_problems = [p for es in eval_sets for p in es.problems]
    max_len = max(len(encode(p.prompt)) for p in task.train + eval_problems) + g.max_tokens + 1
    common = dict(block_size=g.block_size, max_model_len=min(max_len, model.config.max_position_embeddings),
                  attention_backend=cfg.attention_backend, enforce_eager=g.enforce_eager)
    eval_seqs = min(256, (len(eval_problems) if cfg.eval.sets else cfg.task.num_eval) * cfg.eval.k)
    num_kv_blocks, memory_plan = g.num_kv_blocks or None, None
    if num_kv_blocks is None and model.device.type == "cuda":
        # one plan per device: training state + the learner's activations + a reserve; KV from the rest
        total = torch.cuda.get_device_properties(model.device).total_memory
        memory_plan = plan_for_config(cfg, device_bytes=total, max_model_len=common["max_model_len"],
                                      world_size=dist.world)
        num_kv_blocks = memory_plan.num_kv_blocks
    elif num_kv_blocks is None:  # CPU: room for either engine at full length
        num_kv_blocks = max(g.b_gen, eval_seqs) * -(-common["max_model_len"] // g.block_size)
    llm = LLM(model, max_num_seqs=g.b_gen, num_kv_blocks=num_kv_blocks, seed=cfg.run.seed,
              record_routing=g.record_routing, **common)
    # the eval engine shares the rollout engine's KV pool: one cache per device, never a second one
    eval_llm = LLM(model, max_num_seqs=eval_seqs, seed=cfg.run.seed + 1, kv_pool=llm.kv_pool, **common)
    return llm, eval_llm, memory_plan


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool = False, resume_from: str | Path | None = None,
                 dist: Dist | None = None, profile: str | Path | None = None, profile_window: str = "1:2"):
        """resume / resume_from: continue from the latest checkpoint of `resume_from` (default: run.out_dir);
        metrics go to run.out_dir either way. dist: this rank (default: from torchrun's environment).
        profile: a directory for a torch.profiler trace of the RL updates in profile_window (START:STOP)."""
        self.cfg = cfg
        self.profile = (profile, ProfileWindow.parse(profile_window))
        self.dist = dist if dist is not None else init_from_env()
        self.dist.check_same("config", cfg.to_dict())
        self.run_dir = Path(cfg.run.out_dir)
        self.resume_dir = Path(resume_from) if resume_from is not None else (self.run_dir if resume else None)
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        self.model, self.tok = _build_model(cfg, self.dist)
        self.task = build_task(cfg.task.name, path=cfg.task.path, eval_path=cfg.task.eval_path,
                               reward=cfg.task.reward, num_train=cfg.task.num_train, num_eval=cfg.task.num_eval,
                               seed=cfg.task.seed)
        g, t = cfg.gen, cfg.train
        self.encode = PromptEncoder(self.tok, chat_template=cfg.task.chat_template,
                                    system_prompt=cfg.task.system_prompt)
        self.eval_sets = build_eval_sets(self.task, cfg.eval)
        self.llm, self.eval_llm, self.memory_plan = _build_engines(cfg, self.model, self.task, self.encode,
                                                                   self.eval_sets, self.dist)
        self.sampler = PrioritySampler(len(self.task.train), cfg.run.seed, enabled=t.priority_sampling)
        if g.filtered and g.logprobs_mode == "raw":
            warnings.warn("gen.top_k / gen.top_p filter the sampled distribution but gen.logprobs_mode = 'raw' "
                          "returns full-vocabulary log-probs: importance ratios are biased; use 'processed'",
                          stacklevel=2)
        params = SamplingParams(n=t.group_size, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                max_tokens=g.max_tokens, logprobs_mode=g.logprobs_mode)
        # where rewards run; a pool spawns its workers now, so they import while the rest is built
        self.rewards = make_runner(self.task.reward_fn, cfg.task.reward, workers=cfg.task.reward_workers,
                                   timeout=cfg.task.reward_timeout)
        self.collector = RolloutCollector(self.llm, self.tok, self.task, group_size=t.group_size, b_train=t.b_train,
                                          b_gen=g.b_gen, params=params, sampler=self.sampler,
                                          dynamic_sampling=t.dynamic_sampling and t.algo == "grpo",
                                          max_lag=g.max_lag, max_reward_error_frac=cfg.task.max_reward_error_frac,
                                          dist=self.dist, seed=cfg.run.seed, runner=self.rewards,
                                          encode_prompt=self.encode)
        self.evaluator = Evaluator(self.eval_llm, self.encode, self.rewards, self.tok, self.eval_sets, cfg.eval,
                                   max_tokens=g.max_tokens, seed=cfg.run.seed,
                                   max_error_frac=cfg.task.max_reward_error_frac, dist=self.dist)
        self.outputs = RunOutputs(self.run_dir, tensorboard=cfg.run.tensorboard, write=self.dist.is_main)
        self.update, self.N = 0, 0
        self.history: list[dict] = []
        # the GPU this rank uses (NVML numbers every GPU on the node): mapped by UUID / PCI bus id
        cuda = [self.model.device.index or 0] if self.model.device.type == "cuda" else None
        self.telemetry = NvmlSampler(cuda_devices=cuda)  # says plainly when GPU telemetry is unavailable
        self.timer = PhaseTimer(self.model.device)  # t_gen / t_train; syncs only at phase ends
        self.llm.phase_listener = self.telemetry
        self.warmstart_losses: list[float] = []
        if self.resume_dir is None:
            if self.dist.is_main:
                (self.run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
                self.outputs.reset()
            w = cfg.warmstart
            self.warmstart_losses = format_warmstart(self.model, self.tok, self.task, steps=w.steps, lr=w.lr,
                                                     batch=w.batch, seed=cfg.run.seed, encode_prompt=self.encode)
        # Built after the warm start: the KL reference and the PPO critic start from the policy at
        # update 0, not from the random initialisation (on resume, the checkpoint restores both).
        self.learner = Learner(self.model, t, temperature=g.temperature, replay_routing=g.record_routing,
                               logprobs_mode=g.logprobs_mode, top_k=g.top_k, top_p=g.top_p, dist=self.dist)
        if self.resume_dir is not None:
            self._resume()
        # GPU: capture decode graphs now, not inside timed steps, on the parameters the engine reads
        # (under FSDP the unsharded ones: graphs are re-captured when their storage moves)
        self._graph_weights, self.graph_recaptures = None, 0
        with self.dist.unsharded(self.model):
            self.refresh_decode_graphs()

    def refresh_decode_graphs(self) -> None:
        """(Re-)capture the engines' decode graphs when the parameters' storage differs from the one
        they were captured on. A graph replays fixed addresses; FSDP allocates the unsharded storage
        anew at each unshard (replicas and one process never move, so they capture once)."""
        weights = tuple(p.data_ptr() for p in self.model.parameters())
        if weights == self._graph_weights:
            return
        for llm in (self.llm, self.eval_llm):
            graphs = llm.runner.graphs
            if graphs is not None and self._graph_weights is not None:
                llm._use_decode_graphs(graphs.graph_cls, graphs.sizes)  # drops the stale captures
                self.graph_recaptures += 1
            llm.capture_decode_graphs()
        self._graph_weights = weights

    # ---- evaluation --------------------------------------------------------------------------
    def evaluate(self) -> float:
        """J: the primary eval set's mean@k (evaluation.py); every set's mean@k and pass@k go to
        self.eval_metrics. Eval prompt i runs on rank i mod K with seed request_seed(run seed + 1, i)."""
        with self.dist.unsharded(self.model):
            self.refresh_decode_graphs()
            self.eval_metrics = self.evaluator.run()
        self.eval_reward_errors = self.eval_metrics["eval_reward_errors"]
        return self.eval_metrics["J"]

    # ---- one update --------------------------------------------------------------------------
    def train_step(self) -> dict:
        t = self.cfg.train
        stats = CollectStats()
        trace_start = len(self.llm.trace)
        preempt0, recompute0 = self.llm.scheduler.num_preemptions, self.llm.scheduler.num_recomputed_tokens
        self.timer.reset()
        with self.timer.phase("gen"), self.dist.unsharded(self.model):  # FSDP: decode from full weights
            self.refresh_decode_graphs()
            groups = self.collector.collect(stats)
        overlong, penalty = shape_overlong(groups, t.overlong, max_tokens=self.cfg.gen.max_tokens,
                                           buffer=t.overlong_buffer)
        self.learner.set_lr_factor(lr_factor(self.update, schedule=t.lr_schedule, warmup=t.warmup_updates,
                                             total=t.updates, min_ratio=t.min_lr_ratio))
        if t.algo == "grpo":
            batch = grpo_batch(groups, normalize_std=t.normalize_std)
        else:  # PPO: every response of every group enters the update; the critic scores each
            batch = ppo_batch(groups)
        batch = batch.to(self.model.device)
        critic_only = t.algo == "ppo" and self.update < t.critic_warmup
        with self.timer.phase("train"):
            m = self.learner.step(batch, critic_only=critic_only, phases=self.telemetry)
        self.telemetry.set_phase("idle")
        t_gen_rank, t_train_rank = self.timer.total("gen"), self.timer.total("train")
        t_gen, t_train = self.dist.all_max([t_gen_rank, t_train_rank])  # the ranks' slowest gates the update
        if not m["skipped"] and not critic_only:
            self.llm.weight_version += 1
        if not critic_only:
            self.N += t.b_train
        self.update += 1
        boundary = build_boundary_record(self.llm.trace[trace_start:], responses=t.b_train, t_gen=t_gen,
                                         t_train=t_train,
                                         preemptions=self.llm.scheduler.num_preemptions - preempt0,
                                         recomputed_tokens=self.llm.scheduler.num_recomputed_tokens - recompute0)
        rewards = torch.tensor(stats.rewards, dtype=torch.float64)  # every rank's, in global order
        consumed = self.llm.weight_version - (0 if m["skipped"] or critic_only else 1)
        lags = [lag for part in self.dist.all_gather_objects([g.lag(consumed) for g in groups]) for lag in part]
        tokens, seqs, overlong, penalty = self.dist.all_sum(
            [float(sum(len(c) for g in groups for c in g.completions)), float(batch.num_seqs), float(overlong),
             penalty])
        if self.cfg.run.samples_every and self.update % self.cfg.run.samples_every == 0:
            self._write_samples(groups, batch)
        record = {
            "update": self.update, "N": self.N, "critic_only": critic_only, "skipped": m["skipped"],
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
            "retained_fraction": stats.retained_fraction, "groups_dropped": stats.groups_dropped,
            "stale_dropped": stats.groups_stale, "stale_aborted": stats.stale_aborted,
            "reward_errors": stats.reward_errors,
            "filter_fallback": stats.filter_fallback,
            "t_gen": t_gen, "t_train": t_train, "q_gen": t.b_train / t_gen, "q": t.b_train / (t_gen + t_train),
            "actor_grad_norm": m["actor_grad_norm"], "critic_grad_norm": m["critic_grad_norm"],
            "loss": m["loss"], "value_loss": m["value_loss"], "clip_frac": m["clip_frac"],
            "approx_kl": m["approx_kl"], "kl_ref": m["kl_ref"], "entropy": m["entropy"],
            "logprob_diff": m["logprob_diff"], "routing_disagreement": m["routing_disagreement"],
            "policy_lag_mean": sum(lags) / len(lags), "policy_lag_max": max(lags),
            "response_len_mean": tokens / max(seqs, 1.0), "lr": self.learner.opt.param_groups[0]["lr"],
            "b_act_mean": boundary.b_act.mean, "b_act_p50": boundary.b_act.p50, "b_act_p90": boundary.b_act.p90,
            "b_act_frac_time_below": boundary.b_act.frac_time_below, "gen_tokens": boundary.generated_tokens,
            "preemptions": boundary.preemptions,
            "overlong_frac": overlong / max(seqs, 1.0), **stats.reward_components,
        }
        if t.overlong == "soft":
            record["overlong_penalty_mean"] = penalty / max(seqs, 1.0)
        if self.dist.enabled:  # per-rank views: wall-clock of each rank's phases and its decode batches
            record.update(zip(("t_gen_ranks", "t_train_ranks", "b_act_mean_ranks"), zip(*self.dist.all_gather_objects(
                (t_gen_rank, t_train_rank, boundary.b_act.mean)))))
            record.update({k: list(v) for k, v in record.items() if k.endswith("_ranks")})
        if m["skipped"] and self.dist.is_main:
            print(f"update {self.update}: non-finite loss or gradient, update skipped (weights unchanged)")
        return record

    # ---- the loop -----------------------------------------------------------------------------
    def run(self, stop_after: int | None = None, stop_when=None) -> list[dict]:
        """Train until train.updates (or `stop_after` updates, for tests); checkpoint at the end.

        stop_when(record) -> bool, checked after each logged update, ends the run early (e.g. the
        tuner stops a curve at its first evaluation with J >= J*); self.stopped_early says so.
        """
        self.stopped_early = False
        cfg = self.cfg
        last = min(cfg.train.updates, stop_after) if stop_after else cfg.train.updates
        try:
            if self.update == 0:
                j = self.evaluate()
                self._log({"update": 0, "N": 0, "J": j, **self._eval_record()})
            self._loop(last, stop_when)
            self.checkpoint()
        finally:  # a reward pool's workers never outlive the run, whatever ended it
            self.rewards.close()
            self.outputs.close()
        return self.history

    def _loop(self, last: int, stop_when) -> None:
        from rlengine.rl.progress import Progress

        cfg = self.cfg
        out, window = self.profile
        profiler = step_profiler(out if self.dist.is_main else None, name="train", window=window,
                                 device=self.model.device, ranges=[self.llm.ranges, self.learner.ranges])
        self.telemetry.start()
        progress = Progress(cfg.train.updates, start=self.update, enabled=cfg.run.progress and self.dist.is_main)
        with profiler, progress as bar:
            while self.update < last:
                n_before = self.N
                record = self.train_step()
                if self._eval_due(n_before):
                    record["J"] = self.evaluate()
                    record.update(self._eval_record())
                self._log(record)
                bar.advance(record)
                if stop_when is not None and stop_when(record):
                    self.stopped_early = True
                    break
                if cfg.run.checkpoint_every and self.update % cfg.run.checkpoint_every == 0:
                    self.checkpoint()
                profiler.step()  # one profiler step = one RL update (collect, update, eval, log)
        if profiler.trace_path:
            print(f"profile of updates {window.start}..{window.stop - 1}: {profiler.trace_path} {profiler.note}")
        self.telemetry.stop()
        self._write_telemetry()

    def _eval_record(self) -> dict:
        """The last evaluation's fields of a metrics record (J itself is set by the caller)."""
        return {k: v for k, v in self.eval_metrics.items() if k != "J"}

    def _write_samples(self, groups, batch) -> None:
        """samples.jsonl rows of this update's responses (every rank's, gathered on rank 0)."""
        advantages = [float(batch.advantages[e - 1]) for e in batch.cu_seqlens[1:]]  # a response's last token
        rows = samples_rows(groups, advantages, self.tok, update=self.update, n=self.N)
        rows = [r for part in self.dist.all_gather_objects(rows) for r in part] if self.dist.enabled else rows
        self.outputs.samples(rows)

    def _eval_due(self, n_before: int) -> bool:
        """After an update: every eval.every updates, or each time N crosses a multiple of
        eval.every_responses (the same N grid for every B_train), and at the end."""
        e = self.cfg.eval
        if self.update == self.cfg.train.updates:
            return True
        if e.every_responses > 0:
            return self.N // e.every_responses > n_before // e.every_responses
        return self.update % e.every == 0

    def _write_telemetry(self) -> None:
        """Per-phase GPU telemetry (or why there is none) to RUN_DIR/telemetry.json. Every rank samples
        its own device; rank 0 gathers them and writes one file (its own summary at the top level,
        every rank's under "ranks")."""
        steps = [r for r in self.history if r["update"] > 0]
        summary = self.telemetry.summary(responses=sum(self.cfg.train.b_train for _ in steps),
                                         tokens=sum(r.get("gen_tokens", 0) for r in steps))
        payload = {"available": summary.available, "reason": summary.reason,
                   "phases": {k: dataclasses.asdict(v) for k, v in summary.phases.items()}}
        ranks = self.dist.all_gather_objects(json.loads(json.dumps(payload, default=str)))
        if not self.dist.is_main:
            return
        print(summary.format())
        if self.dist.enabled:
            payload["ranks"] = ranks
        (self.run_dir / "telemetry.json").write_text(json.dumps(payload, indent=2, default=str))

    def _log(self, record: dict) -> None:
        self.history.append(record)
        self.outputs.log(record)

    # ---- checkpoints --------------------------------------------------------------------------
    def checkpoint(self) -> Path:
        self.collector.drain()  # async in-flight rollouts are not saved; they are regenerated after resume
        state = {"update": self.update, "N": self.N, "weight_version": self.llm.weight_version,
                 "sampler": self.sampler.state_dict(),
                 "torch_rng": torch.get_rng_state().tolist(),
                 "engine_rng": self.llm.runner.sampler.generator.get_state().tolist(),
                 "ready": len(self.collector.ready), "next_request": self.collector.next_request,
                 "world_size": self.dist.world}
        self.collector.ready.clear()
        ln = self.learner
        with self.dist.unsharded(*(m for m in (self.model, ln.ref, ln.critic) if m is not None)):
            path = save_checkpoint(self.run_dir, self.update, model=self.model, learner=ln, state=state,
                                   write=self.dist.is_main)
        self.dist.barrier()  # no rank resumes or exits before the checkpoint is complete
        return path

    def _resume(self) -> None:
        path = latest_checkpoint(self.resume_dir)
        state = load_checkpoint(path, model=self.model, learner=self.learner)
        self.update, self.N = state["update"], state["N"]
        self.collector.next_request = state.get("next_request", 0)
        self.llm.weight_version = state["weight_version"]
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        self.llm.runner.sampler.generator.set_state(torch.tensor(state["engine_rng"], dtype=torch.uint8))
        metrics = self.resume_dir / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        kept = [ln for ln in lines if ln and json.loads(ln)["update"] <= self.update]
        self.dist.barrier()  # every rank has read the old metrics before rank 0 rewrites them
        if self.dist.is_main:
            (self.run_dir / "metrics.jsonl").write_text("".join(ln + "\n" for ln in kept))
            (self.run_dir / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2))
            self.outputs.reset(keep_through=self.update)
        self.history = [json.loads(ln) for ln in kept]
