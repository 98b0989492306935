"""One line of documentation per config field, `section.field` -> what it means and its units.

`rlengine config show` prints these next to each value and default; tests/rl/test_config_docs.py
checks that every field of every section (sections.py) has an entry and that no entry names a field
that does not exist. Kept in a table beside the dataclasses, not in field metadata, so the section
classes stay readable as plain declarations. Symbols (B_train, B_gen, N, J, ...) are those of
docs/METHOD.md.
"""

from rlengine.rl.algo.registry import ALGORITHMS

FIELD_DOCS: dict[str, str] = {
    # [model]
    "model.name": "preset (tiny, qwen3-0.6b, ...; `rlengine info`), HF checkpoint directory, or hub id org/name "
                  "(cached or downloaded)",
    "model.revision": "hub ids only: the branch, tag or commit sha to load (\"\" = the repo's default branch)",
    "model.tokenizer": "a directory or hub id to take the tokenizer from (\"\" = the model's own); its "
                       "vocabulary must fit the model's",
    "model.dtype": "weights and compute dtype: float32 | bfloat16 | float16 | float64 (tests)",
    "model.device": "cpu | cuda | cuda:N; auto = cuda if available, else cpu",
    "model.moe_impl": "MoE expert kernels: ref (torch loop) | triton | auto (triton on a GPU with triton)",
    "model.lora_r": "LoRA rank r: train adapters x A B on the frozen base; 0 = full fine-tuning",
    "model.lora_alpha": "LoRA alpha: the adapters' output is scaled by lora_alpha / lora_r",
    "model.lora_dropout": "dropout on the adapters' input in the learner's forward, in [0, 1); 0 keeps log-probs exact",
    "model.lora_target_modules": "PEFT names q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (list or "
                                 "comma-separated), or all-linear",
    "model.lora_path": "a PEFT adapter directory (adapter_config.json) to start from; empty = a fresh adapter",
    "model.lora_modules_to_save": "PEFT's modules_to_save: lm_head and/or embed_tokens train full copies (tied embeddings: "
                                  "one copy for both); the KL reference keeps the base",
    # [task]
    "task.name": "built-in task (first-digit, copy-digits, ...) or jsonl for a data file",
    "task.path": "training JSONL file for name = jsonl ({prompt, answer} or GSM8K rows; rlengine:PATH = packaged)",
    "task.eval_path": "held-out JSONL file; empty = a split of task.path",
    "task.reward": "reward: exact | math | format | plugin 'pkg.module:fn'; empty = the task's own",
    "task.num_train": "training prompts drawn from a built-in task",
    "task.num_eval": "held-out prompts of a built-in task",
    "task.seed": "seed of the built-in task's prompts and of the train / eval split",
    "task.max_reward_error_frac": "rewards that raise score 0 up to this fraction of a batch; above it the run stops",
    "task.reward_workers": "0 = score in this process; N > 0 = a pool of N spawned worker processes",
    "task.reward_timeout": "seconds per reward call in the pool; past it the call scores 0 and its worker is replaced",
    "task.chat_template": "wrap each prompt as a chat message through the tokenizer's chat template",
    "task.system_prompt": "system message with chat_template; empty = none",
    # [gen]
    "gen.b_gen": "B_gen: responses in flight, >= B_train; 0 = B_train (coupled), larger = async partial rollouts",
    "gen.temperature": "sampling temperature of rollouts (> 0)",
    "gen.top_p": "nucleus sampling: keep the smallest set of tokens with probability >= top_p; 1 = off",
    "gen.top_k": "keep the k most likely tokens; -1 = off",
    "gen.max_tokens": "response length cap in tokens (longer responses are cut: over-long)",
    "gen.block_size": "tokens per KV-cache block (page)",
    "gen.num_kv_blocks": "KV-cache blocks; 0 = sized from the memory plan (what weights, optimizer and activations leave)",
    "gen.backend": "attention backend for decode: auto | torch | cpp | triton | flashinfer (invariant: the mode's)",
    "gen.max_lag": "async rollouts: abort responses older than this many updates (policy lag)",
    "gen.record_routing": "MoE: record the experts chosen in generation and replay them in the learner",
    "gen.enforce_eager": "GPU: no CUDA graphs for decode steps",
    "gen.logprobs_mode": "behaviour log-probs: processed (the filtered distribution sampled from) | raw (full vocabulary)",
    "gen.batch_invariant": "engine and learner give each token the same bits at any batch size (logprob_diff 0); "
                           "CPU, dense models",
    "gen.cpu_kernels": "CPU projection kernels: cache (timed once per machine, ~/.cache/rlengine) | measure | torch | "
                       "skinny | a saved table's .json (pinned)",
    "gen.shared_prefix_decode": "read a group's shared prompt pages once per decode step (cascade attention): "
                                "auto (cpp on, triton off) | true | false",
    "gen.decode_kernels": "GPU decode layer path: torch (default until a GPU run measures fused faster) | fused "
                          "(six launches a dense layer)",
    # [train]
    "train.algo": "estimator + policy loss shorthand: "
                  + "; ".join(f"{a.name} = {a.summary}" for a in ALGORITHMS.values()),
    "train.group_size": "G, responses per prompt; 0 = 8 for GRPO, 1 for PPO",
    "train.prompts_per_step": "P, prompts per optimizer update (B_train = P x G)",
    "train.b_train": "B_train = P x G retained responses per update; when set, P = b_train / G (0 = from P)",
    "train.updates": "optimizer updates in the run",
    "train.lr": "eta0, the learning rate at the reference batch b0 (0: a frozen policy)",
    "train.b0": "B0, reference batch of the LR rule; 0 = this run's B_train",
    "train.lr_rule": "LR rule eta = eta0 (B_train / B0)^p: sqrt (p = 1/2) | linear (1) | none (0)",
    "train.weight_decay": "AdamW weight decay",
    "train.master_weights": "fp32 master weights: auto (when the model is not fp32) | fp32 | none",
    "train.parallel": "several ranks: none | ddp | fsdp; auto = ddp when the world size is > 1",
    "train.betas": "AdamW (beta1, beta2)",
    "train.micro_batch": "sequences per micro-batch (gradients accumulate); 0 = the largest the memory plan fits",
    "train.max_grad_norm": "clip the global gradient norm of actor (and critic) to this before each step",
    "train.skip_zero_grad": "skip the optimizer step when the policy gradient is exactly 0 (no signal)",
    "train.clip_low": "PPO ratio clip: lower epsilon (ratio >= 1 - clip_low)",
    "train.clip_high": "PPO ratio clip: upper epsilon (ratio <= 1 + clip_high; clip-higher)",
    "train.agg": "loss aggregation: token-mean (over all tokens of the batch) | seq-mean",
    "train.credit": "GRPO credit: sequence (one advantage per response) | token (per-token group advantage)",
    "train.normalize_std": "GRPO: divide group-relative advantages by the group's reward std",
    "train.kl_coef": "k3 KL penalty to a frozen reference policy; 0 = no reference model",
    "train.entropy_coef": "entropy bonus coefficient",
    "train.dynamic_sampling": "GRPO: drop all-pass / all-fail groups and sample more prompts",
    "train.priority_sampling": "sample prompts by estimated pass rate near 0.5",
    "train.critic_lr_mult": "PPO: critic learning rate = this x the actor's",
    "train.critic_warmup": "PPO: critic-only updates first (their responses are not counted in N)",
    "train.overlong": "over-long responses: none | mask (zero loss weight) | soft (DAPO's length penalty)",
    "train.overlong_buffer": "soft: penalty ramp over the last this many tokens; 0 = gen.max_tokens // 4",
    "train.lr_schedule": "on top of the LR rule: constant | linear | cosine, after warmup_updates",
    "train.warmup_updates": "updates of linear LR warm-up",
    "train.min_lr_ratio": "linear / cosine decay ends at min_lr_ratio x lr at the last update",
    "train.gamma": "PPO: GAE discount",
    "train.lam": "PPO: GAE lambda",
    "train.vf_clip": "PPO: value-function clip range",
    "train.vf_coef": "PPO: value-loss coefficient",
    # [warmstart]
    "warmstart.steps": "supervised format warm-start steps before RL (teaches the answer format); 0 = none",
    "warmstart.lr": "learning rate of the warm start",
    "warmstart.batch": "sequences per warm-start step",
    # [eval]
    "eval.every": "updates between evaluations (also at update 0 and at the end)",
    "eval.every_responses": "if > 0: evaluate each time N crosses a multiple of this instead",
    "eval.k": "samples per prompt: J is mean@k",
    "eval.temperature": "evaluation sampling temperature; 0 = greedy",
    "eval.sets": "named eval sets {name = 'path.jsonl'}; empty = the task's held-out split ('heldout')",
    "eval.primary": "the set whose mean@k is J; empty = the first",
    "eval.pass_threshold": "pass@k: a sample counts as correct when its reward >= this",
    # [run]
    "run.name": "the run's label in plots and reports; empty = out_dir's last part",
    "run.out_dir": "run directory (metrics.jsonl, config.json, checkpoints); a taken one gets -1, -2, ...; "
                   "runs/<name> when run.name is set",
    "run.seed": "seed of the model init, sampling and prompt order",
    "run.checkpoint_every": "updates between checkpoints; 0 = only at the end",
    "run.progress": "show a progress bar over the updates",
    "run.samples_every": "every k updates append the batch's responses to samples.jsonl; 0 = never",
    "run.tensorboard": "also write TensorBoard event files in out_dir",
    "run.overwrite": "a new run may replace the run already in out_dir",
    "run.keep_checkpoints": "keep the newest K checkpoints; 0 = all",
    "run.warmstart_cache": "directory of warm starts shared by runs: one stored for the same model, task, "
                           "warm start, seed and threads is loaded",
    "run.dist_timeout_s": "seconds a collective may wait before the job fails (several ranks)",
    "run.save_timeout_s": "seconds ranks wait for a checkpoint save to finish (a group of its own)",
    "run.async_checkpoint": "save checkpoints in the background (sharded, torch.distributed.checkpoint)",
    "train.ppo_epochs": "passes over each rollout batch (verl ppo_epochs, TRL num_iterations); 1 = the paper's single update",
    "train.mini_batches": "optimizer steps per pass, each on 1/mini_batches of the batch; 1 = one step",
    "train.kl_estimator": "k1 | k2 | k3 | low_var_kl (k3 clamped to [-10, 10], as verl) for the KL term and KL in reward",
    "train.kl_in_reward": "fold -kl_reward_coef * KL to the reference into the token rewards (PPO-style)",
    "train.kl_reward_coef": "coefficient of the KL folded into the reward (train.kl_in_reward)",
    "train.clip_ratio_c": "dual-clip bound for negative advantages (> 1, verl clip_ratio_c); unset = off",
    "train.loss_norm_len": "Dr. GRPO's constant length for agg = seq-mean-token-sum-norm; 0 = gen.max_tokens",
    "train.adv_whiten": "none | batch: GRPO advantages whitened over the batch's trained tokens",
    "train.rollout_is": "none | token | sequence: truncated importance weights learner_old / engine on the loss",
    "train.rollout_is_cap": "truncation of the rollout importance weights",
    "train.rollout_is_threshold": "verl's rollout_is_threshold: U truncates at U, L:U zeroes weights outside [L, U] "
                                  "(IcePop); empty = rollout_is_cap",
    "train.rollout_is_batch_normalize": "divide the rollout IS weights by their batch mean (verl's name)",
    "train.rollout_rs": "rejection criteria, comma-chained: token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2..3",
    "train.gdpo_reward_keys": "gdpo: the reward components (keys of a dict-returning reward) normalised per group",
    "train.gdpo_reward_weights": "gdpo: the components' weights in the sum (empty = 1 each)",
    "train.rollout_rs_threshold": "rejection thresholds: one shared or one per criterion; L:U for k1 criteria",
    "train.activation_checkpointing": "recompute each decoder layer in the backward (less activation memory)",
    "train.ref_offload": "keep the KL reference's decoder layers on the host, streamed to the device per layer",
    "train.adv_estimator": "advantage estimator (verl's name) in place of train.algo's; \"\" = its own. README lists them",
    "train.policy_loss": "policy loss (verl's name) in place of train.algo's; \"\" = its own. README lists them",
    "train.tau_pos": "sapo: temperature of the smooth gate where A > 0 (verl actor.tau_pos)",
    "train.tau_neg": "sapo: temperature of the smooth gate where A <= 0 (verl actor.tau_neg)",
    "train.clip_cov_ratio": "clip_cov: fraction of model tokens whose gradient may be cut (verl policy_loss.clip_cov_ratio)",
    "train.clip_cov_lb": "clip_cov: lower bound of the advantage x log-prob covariance of the candidate tokens",
    "train.clip_cov_ub": "clip_cov: upper bound of that covariance window",
    "train.kl_cov_ratio": "kl_cov: fraction of model tokens (top covariance) given the |log ratio| penalty",
    "train.ppo_kl_coef": "kl_cov: coefficient of the |log ratio| penalty (verl policy_loss.ppo_kl_coef)",
    "train.dro_beta": "dro: coefficient of the quadratic log-ratio penalty (> 0; required with policy_loss = dro)",
    "run.wandb": "also log every metric to Weights & Biases (`pip install rlengine[wandb]`; WANDB_MODE=offline works)",
    "run.wandb_project": "the wandb project; the run is named after run.out_dir",
    # [env]
    "env.name": "multi-turn rollouts: \"\" = single-turn, tools = the tool environment, or a plugin "
                "'pkg.module:Name' (README: Multi-turn rollouts)",
    "env.tools": "name = tools: built-in tools (lookup) or plugins 'pkg.module:function' with a tool_schema",
    "env.call_format": "tool-call syntax: hermes (<tool_call>{json}</tool_call>) | compact (name(arg)) | auto "
                       "(hermes with task.chat_template, else compact)",
    "env.max_turns": "model turns per trajectory; a trajectory past it is cut (counted, the environment's on_cut reward)",
    "env.max_turn_tokens": "tokens per model turn; 0 = gen.max_tokens (a trajectory's budget after its prompt)",
    "env.max_obs_tokens": "tokens per observation; a longer one is cut to it (counted)",
    "env.tool_timeout_s": "seconds per tool call; past it the call is answered with an error observation (counted)",
}
