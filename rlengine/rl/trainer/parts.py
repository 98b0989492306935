"""The parts of a training job, built from its TrainConfig: model, tokenizer, task, engines, rewards.

build_parts() is everything the loop needs before the warm start: the model and its tokenizer
(with every EOS id of a checkpoint), the task and its eval sets, the rollout and eval engines
(one KV pool, sized from the memory plan on CUDA), the prompt sampler, the reward runner, the
rollout collector and the evaluator. The learner is built by the loop after the warm start, so
its KL reference and critic start from the policy at update 0.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from rlengine.model.config import ConfigError
from rlengine.engine import LLM, SamplingParams
from rlengine.model.factory import build_model, default_device, resolve_moe_impl, tokenizer_for
from rlengine.model.hub import resolve_model
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.config import TrainConfig
from rlengine.rl.data.prompts import PromptEncoder, check_job_prompts
from rlengine.rl.data.reward_pool import make_runner
from rlengine.rl.data.tasks import Task, build_task
from rlengine.rl.distributed import Dist
from rlengine.rl.env.build import JobEnv
from rlengine.rl.learner.learner import Learner
from rlengine.rl.rollout.baseline import GreedyBaselines
from rlengine.rl.rollout.collector import PrioritySampler, RolloutCollector
from rlengine.rl.rollout.evaluation import EvalSet, Evaluator, build_eval_sets
from rlengine.plan.job import plan_job
from rlengine.plan.memory import shape_of
from rlengine.plan.specs import JobPlan, LearnerSpec


@dataclass(slots=True)
class JobParts:
    """One rank's share of a job, before the warm start and the learner."""

    model: Qwen3ForCausalLM
    tok: Tokenizer
    task: Task
    encode: PromptEncoder                 # prompt text -> ids, chat template applied when asked
    eval_sets: list[EvalSet]
    llm: LLM                              # the rollout engine (max_num_seqs = gen.b_gen)
    eval_llm: LLM                         # the eval engine: the same module, the same KV pool
    plan: JobPlan                         # what was resolved: specs of the engines, rollout and learner, memory
    sampler: PrioritySampler
    rewards: object                       # reward_pool.InlineRunner or RewardPool: close() it
    eval_rewards: object                  # J's runner: `rewards`, or the task's eval_reward_fn's own
    collector: RolloutCollector
    evaluator: Evaluator

    def close(self) -> None:
        """End the reward runners (a pool's worker processes never outlive the run)."""
        self.rewards.close()
        if self.eval_rewards is not self.rewards:
            self.eval_rewards.close()


def build_model_and_tokenizer(cfg: TrainConfig, dist: Dist) -> tuple[Qwen3ForCausalLM, Tokenizer, str]:
    """The model (moe_impl resolved by device), its tokenizer, and the MoE implementation chosen."""
    device = cfg.model.device if cfg.model.device != "auto" else str(default_device())
    if device == "cuda" and dist.enabled:
        device = f"cuda:{dist.local_rank}"  # one device per rank
    # auto: the fused Triton kernels where they run (a GPU; decode graphs stay on), else the torch loop;
    # batch-invariant mode routes every MoE block through its invariant path (model/batch_invariant_moe.py)
    invariant = cfg.gen.batch_invariant and cfg.model.moe_impl == "auto"
    moe_impl = "ref" if invariant else resolve_moe_impl(cfg.model.moe_impl, device)
    name = resolve_model(cfg.model.name, revision=cfg.model.revision, what="model.name")  # a hub id: its snapshot
    model = build_model(name, dtype=cfg.model.dtype, device=device, moe_impl=moe_impl, seed=cfg.run.seed)
    tok = tokenizer_for(name, tokenizer=cfg.model.tokenizer or None)
    if tok.eos_token_id is None:
        raise ConfigError(f"model.name {cfg.model.name!r}: the tokenizer has no EOS token (tokenizer_config.json "
                          "eos_token or generation_config.json eos_token_id), so responses could never end")
    if Path(name).is_dir():  # a checkpoint: stop at its own EOS ids and the tokenizer's
        eos = list(dict.fromkeys(model.config.eos_token_ids + list(getattr(tok, "eos_token_ids", None) or [])
                                 + [tok.eos_token_id]))
        model.config.eos_token_id = eos[0] if len(eos) == 1 else eos
    else:  # a preset: the built-in tokenizer's <eos> is the only end
        model.config.eos_token_id = tok.eos_token_id
    return model, tok, "invariant" if invariant else moe_impl


def build_engines(cfg: TrainConfig, model: Qwen3ForCausalLM, task: Task, encode, eval_sets, dist: Dist, *,
                  moe_impl: str, pinned_micro_batch: int | None = None):
    """The job's plan (plan/job.py: memory, micro-batch, specs) for the longest prompt, after checking
    every train and eval prompt fits, and the rollout and eval engines it specifies (one KV pool);
    returns (llm, eval_llm, plan)."""
    g = cfg.gen
    check_job_prompts(task, eval_sets if cfg.eval.sets else [], encode,
                      max_position_embeddings=model.config.max_position_embeddings, max_tokens=g.max_tokens)
    eval_problems = [p for es in eval_sets for p in es.problems]
    shape = shape_of(cfg, [len(encode(p.prompt)) for p in task.train + eval_problems], len(eval_problems),
                     model.config.max_position_embeddings)
    plan = plan_job(cfg, model, shape, dist, moe_impl=moe_impl, pinned_micro_batch=pinned_micro_batch)
    llm = LLM.from_spec(model, plan.engine)
    eval_llm = LLM.from_spec(model, plan.eval_engine, kv_pool=llm.kv_pool)
    if dist.enabled and model.device.type == "cpu" and not model.batch_invariant:
        _agree_on_cpu_kernels(model, max(plan.engine.max_num_seqs, plan.eval_engine.max_num_seqs),
                              llm.max_num_batched_tokens, dist)
    return llm, eval_llm, plan


def _agree_on_cpu_kernels(model: Qwen3ForCausalLM, max_seqs: int, max_tokens: int, dist: Dist) -> None:
    """Several CPU ranks: rank 0 times every projection shape class its engines can meet and every
    rank pins that table (torch's linear for anything outside it), so all ranks decode alike."""
    from rlengine.model import ops

    rows = sorted({*range(1, 9), *(1 << k for k in range(4, max(4, max_tokens - 1).bit_length() + 1))})
    table = None
    if dist.rank == 0:
        table = ops.decide_for_model(model.config, model.lm_head.weight.dtype, rows,
                                 logits_rows=[r for r in rows if r <= max(8, max_seqs)])
    table = dist.all_gather_objects(table)[0]
    ops.KERNELS.configure("torch", table=table)


def build_parts(cfg: TrainConfig, dist: Dist, *, pinned_micro_batch: int | None = None) -> JobParts:
    """Everything but the learner, in the order the run's random streams expect: both seeded from
    run.seed, then the model's initialisation first. pinned_micro_batch: a resumed run's (plan_job)."""
    g, t = cfg.gen, cfg.train
    torch.manual_seed(cfg.run.seed)
    random.seed(cfg.run.seed)
    model, tok, moe_impl = build_model_and_tokenizer(cfg, dist)
    task = build_task(cfg.task.name, path=cfg.task.path, eval_path=cfg.task.eval_path, reward=cfg.task.reward,
                      num_train=cfg.task.num_train, num_eval=cfg.task.num_eval, seed=cfg.task.seed)
    if t.credit == "token" and task.token_credit is None:
        raise ConfigError(f"train.credit = 'token' needs a task with per-token credit (copy-digits, "
                          f"reverse-digits, shift-digits); task {task.name!r} has only a sequence reward")
    # multi-turn: the [env] environment (rl/env/build.py), one driver per engine; None = single-turn
    job_env = JobEnv.from_config(cfg.env, task.reward_fn, tok, max_tokens=g.max_tokens, chat=cfg.task.chat_template)
    encode = PromptEncoder(tok, chat_template=cfg.task.chat_template, system_prompt=cfg.task.system_prompt,
                           tools=job_env.tool_schemas if job_env is not None else None)
    eval_sets = build_eval_sets(task, cfg.eval)
    llm, eval_llm, plan = build_engines(cfg, model, task, encode, eval_sets, dist, moe_impl=moe_impl,
                                        pinned_micro_batch=pinned_micro_batch)
    r = plan.rollout
    sampler = PrioritySampler(len(task.train), cfg.run.seed, enabled=t.priority_sampling)
    if g.filtered and g.logprobs_mode == "raw":
        warnings.warn("gen.top_k / gen.top_p filter the sampled distribution but gen.logprobs_mode = 'raw' "
                      "returns full-vocabulary log-probs: importance ratios are biased; use 'processed'",
                      stacklevel=3)
    params = SamplingParams(n=r.group_size, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                            max_tokens=r.max_tokens, logprobs_mode=g.logprobs_mode)
    # where rewards run; a pool spawns its workers now, so they import while the rest is built
    rewards = make_runner(task.reward_fn, cfg.task.reward, workers=cfg.task.reward_workers,
                          timeout=cfg.task.reward_timeout)
    # J's own reward when the task trains on another one (the long tasks: partial credit, J exact match)
    eval_rewards = rewards if task.eval_reward_fn is None else make_runner(
        task.eval_reward_fn, "", workers=cfg.task.reward_workers, timeout=cfg.task.reward_timeout)
    collector = RolloutCollector(llm, tok, task, group_size=r.group_size, b_train=r.b_train, b_gen=r.b_gen,
                                 params=params, sampler=sampler, dynamic_sampling=r.dynamic_sampling,
                                 max_lag=r.max_lag, max_reward_error_frac=cfg.task.max_reward_error_frac, dist=dist,
                                 seed=cfg.run.seed, runner=rewards, encode_prompt=encode,
                                 token_credit=r.token_credit,
                                 env=job_env.driver("rollout") if job_env is not None else None,
                                 baselines=GreedyBaselines(llm, tok, rewards, params) if r.greedy_baseline else None)
    evaluator = Evaluator(eval_llm, encode, eval_rewards, tok, eval_sets, cfg.eval, max_tokens=g.max_tokens,
                          seed=cfg.run.seed, max_error_frac=cfg.task.max_reward_error_frac, dist=dist,
                          env=job_env.driver("eval") if job_env is not None else None)
    return JobParts(model=model, tok=tok, task=task, encode=encode, eval_sets=eval_sets, llm=llm, eval_llm=eval_llm,
                    plan=plan, sampler=sampler, rewards=rewards, eval_rewards=eval_rewards,
                    collector=collector,
                    evaluator=evaluator)


def build_learner(spec: LearnerSpec, model: Qwen3ForCausalLM, dist: Dist) -> Learner:
    """The learner over the job's model from its spec (the engine's log-prob definition included)."""
    return Learner(model, spec, dist=dist)
