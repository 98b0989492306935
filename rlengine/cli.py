"""The `rlengine` command line: one subcommand per job, each parsed here and run by its module.

Library code never parses argv; this file is the only place that does. Imports are lazy so
`rlengine --help` is instant.
"""

from __future__ import annotations

import argparse
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset name (see `rlengine info`) or HF checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")


def _cmd_info(args) -> int:
    import torch

    from rlengine import _ext
    from rlengine.config import PRESETS, preset

    if args.plan:  # the per-device memory plan of a training config, and its B_KV
        from rlengine.analysis.memory_plan import GiB, device_memory, engine_max_model_len, plan_for_config
        from rlengine.rl.config import load_config

        cfg = load_config(args.plan)
        mem, source = (int(args.device_memory * GiB), "--device-memory") if args.device_memory else device_memory()
        cuda = args.device_memory is not None or torch.cuda.is_available()
        plan = plan_for_config(cfg, device_bytes=mem, max_model_len=engine_max_model_len(cfg),
                               device_type="cuda" if cuda else "cpu")
        print(f"memory plan of {args.plan} ({cfg.model.name}, {cfg.model.dtype}; device memory from {source}):")
        print("\n".join("  " + line for line in plan.lines()))
        return 0

    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    for line in _ext.status_lines():  # both extensions, with the recorded build error of a failed one
        print(line)
    if _ext.AVAILABLE:
        cuda_ops = [op for op in _ext.CPP_OPS if _ext.has_cuda_op(op)]
        print(f"  CPU ops: {', '.join(op for op in _ext.CPP_OPS if _ext.has_op(op))}")
        print(f"  CUDA ops: {', '.join(cuda_ops) if cuda_ops else 'none (a CPU build of torch, or no nvcc)'}")
    from rlengine.engine.attention import AUTO_ORDER, BACKENDS

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"attention backends on {device}:")
    for name, cls in BACKENDS.items():
        reason = cls.unavailable_reason(device) if hasattr(cls, "unavailable_reason") else None
        print(f"  {name:10s} {'available' if reason is None else 'unavailable: ' + reason}")
    print(f"  auto picks the first available of {' > '.join(AUTO_ORDER[device.type])} (flashinfer: opt-in)")
    graphs = "on by default (enforce_eager=True turns them off)" if device.type == "cuda" else "off (no CUDA device)"
    print(f"decode CUDA graphs: {graphs}")
    print("presets:")
    for name in PRESETS:
        cfg = preset(name)
        kind = f"MoE E={cfg.num_experts} K={cfg.num_experts_per_tok}" if cfg.is_moe else "dense"
        print(f"  {name:16s} L={cfg.num_hidden_layers} C={cfg.hidden_size} H={cfg.num_attention_heads} "
              f"Hkv={cfg.num_key_value_heads} D={cfg.head_dim} V={cfg.vocab_size} {kind}")
    return 0


def _cmd_demo(args) -> int:
    from rlengine.demo import run_demo

    run_demo(model=args.model, dtype=args.dtype, device=args.device, prompt=args.prompt,
             max_tokens=args.max_tokens)
    return 0


def _cmd_train(args) -> int:
    from rlengine.rl.trainer import Trainer

    if args.nproc is not None:
        return _launch(args)
    # --resume: the run's own config; only overrides that keep its meaning apply (RESUME_OVERRIDABLE)
    trainer = Trainer(_train_config(args), resume_from=args.resume, profile=args.profile,
                      profile_window=args.profile_window)
    history = trainer.run()
    trainer.dist.close()
    if not trainer.dist.is_main:
        return 0
    js = [(r["N"], r["J"]) for r in history if r.get("J") is not None]
    print("J against N (held-out accuracy):")
    for n, j in js:
        print(f"  N={n:6d}  J={j:.3f}")
    print(f"run directory: {trainer.run_dir}")
    return 0


def _train_config(args):
    """The config `rlengine train` would run (validated), without building anything."""
    from importlib import resources

    from rlengine.rl.config import load_config, resume_config

    if args.resume:
        return resume_config(args.resume, args.overrides)
    path = args.config or str(resources.files("rlengine") / "configs" / f"{args.algo}.toml")
    return load_config(path, args.overrides)


def _launch(args) -> int:
    """`rlengine train --nproc K`: check the config here (one clear error, no process started), then
    start K ranks of the same command through torch's elastic launcher (what torchrun runs)."""
    from torch.distributed.run import get_args_parser, run

    from rlengine.config import ConfigError

    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    _train_config(args)
    argv = ["train"] + (["--config", args.config] if args.config else []) + ["--algo", args.algo]
    argv += (["--resume", args.resume] if args.resume else []) + list(args.overrides)
    argv += ["--profile", args.profile, "--profile-window", args.profile_window] if args.profile else []  # rank 0 writes
    launcher = get_args_parser().parse_args(
        ["--nproc-per-node", str(args.nproc), "--standalone", "-m", "rlengine", *argv])
    try:
        run(launcher)
    except Exception as exc:  # noqa: BLE001 - a rank failed: it printed its own error; say which, once
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if not isinstance(exc, ChildFailedError):
            raise
        failures = ", ".join(f"rank {r} (exit code {f.exitcode})" for r, f in sorted(exc.failures.items()))
        print(f"rlengine train: {failures} failed; the job was stopped", file=sys.stderr)
        return 1
    return 0


def _int_list(text: str, what: str) -> tuple[int, ...]:
    from rlengine.config import ConfigError

    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{what} must be a comma-separated list of integers, got {text!r}") from None


def _cmd_tune(args) -> int:
    """Algorithm 1 (rlengine.tune): stage 1, stage 2, choice, confirmation, report in --out."""
    from importlib import resources

    from rlengine.config import ConfigError
    from rlengine.rl.config import load_config
    from rlengine.tune import TuneSpec, tune

    path = args.config or str(resources.files("rlengine") / "configs" / f"{args.algo}.toml")
    job = load_config(path).to_dict()
    b = job["train"]["b_train"]
    auto_gen = args.b_gen == "auto"
    try:
        spec = TuneSpec(job=job, target_j=args.target_j,
                        b_train=(_int_list(args.b_train, "--b-train") if args.b_train
                                 else (b // 2, b, 2 * b, 4 * b)),
                        seeds=tuple(range(args.first_seed, args.first_seed + args.seeds)), n_max=args.n_max,
                        eval_every=args.eval_every,
                        stop_at_target=not args.full_curves, fixed_lr=args.fixed_lr,
                        b_gen=() if auto_gen else _int_list(args.b_gen, "--b-gen"), explicit_b_gen=not auto_gen,
                        plateau_delta=args.delta, kv_bytes=args.kv_bytes, recheck=args.recheck,
                        confirm_seeds=args.confirm_seeds, budget_s=args.budget_s, clock=args.clock)
    except ValueError as exc:
        raise ConfigError(f"tune: {exc}") from None
    result = tune(spec, args.out, resume=args.resume)
    print(f"chosen: {result.chosen or 'none'}; report: {args.out}/report.md")
    return 0


def _cmd_report(args) -> int:
    """Table 1 and figures from existing run directories (rlengine.tune.report_runs)."""
    from rlengine.config import ConfigError
    from rlengine.tune import report_runs
    from rlengine.tune.report import table_markdown, write_runs_report

    try:
        result = report_runs(args.runs, args.target_j, reference=args.reference, delta=args.delta)
    except ValueError as exc:
        raise ConfigError(f"report: {exc}") from None
    print(table_markdown(result.rows, result.reference))
    print(f"best: {result.chosen or 'none'}")
    for note in result.notes:
        print(f"note: {note}")
    if args.out:
        print(f"report: {write_runs_report(result, args.out)}")
    return 0


def _cmd_bench(args) -> int:
    import importlib

    from rlengine.benchmarks import BENCHMARKS

    if args.name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {args.name!r}; choose from {', '.join(BENCHMARKS)}")
    return importlib.import_module(f"rlengine.benchmarks.{args.name}").main(args.args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlengine", description="Single-process RL engine for LLMs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("info", help="show presets, devices and whether the C++ extension is built")
    p.add_argument("--plan", default=None, metavar="CONFIG",
                   help="print the per-device memory plan (and B_KV) of a training config instead")
    p.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                   help="device memory for --plan in GiB (default: this CUDA device's, else this machine's RAM)")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("demo", help="greedy generation from a preset or checkpoint through the plain forward")
    _add_model_args(p)
    p.add_argument("--prompt", default="12+34=", help="prompt text (built-in tokenizer for presets)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("train", help="run GRPO/PPO (default: GRPO on a built-in task with the tiny preset)",
                       description="Run an RL job. With no arguments: the embedded default (GRPO, tiny preset, "
                       "built-in first-digit task, CPU if no GPU). Override any config field with dotted "
                       "options, e.g. --train.b_train 256 --gen.b_gen 512.")
    p.add_argument("--config", default=None, help="TOML config file (default: the bundled grpo/ppo config)")
    p.add_argument("--algo", default="grpo", choices=["grpo", "ppo"], help="which bundled config to use")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    p.add_argument("--nproc", type=int, default=None, metavar="K",
                   help="run K ranks on this node (torchrun; one device each, gloo on CPU, nccl on CUDA)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write a torch.profiler trace (Chrome / Perfetto JSON) of --profile-window updates to DIR")
    p.add_argument("--profile-window", default="1:2", metavar="START:STOP",
                   help="RL updates to record (0-based; update START-1 is the profiler's warm-up)")
    p.set_defaults(func=_cmd_train)

    from rlengine.benchmarks import BENCHMARKS

    p = sub.add_parser("bench", help="run a benchmark: " + "; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()),
                       description="\n".join(f"{k}: {v}" for k, v in BENCHMARKS.items()) +
                       "\n`rlengine bench NAME --help` shows a benchmark's options.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=list(BENCHMARKS), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="options passed to the benchmark")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("tune", help="Algorithm 1: find the B_train / B_gen that reach a target J soonest",
                       description="Stage 1: sample-matched curves per B_train with the sqrt LR rule (r_N at J*); "
                       "stage 2: raise B_gen until q plateaus or B_KV; choose max q / r_N; confirm against the "
                       "job on fresh seeds; write report.md, report.json, chosen.toml, runs.jsonl, figures/.")
    p.add_argument("--config", default=None, help="the job's TOML (default: the bundled grpo/ppo config)")
    p.add_argument("--algo", default="grpo", choices=["grpo", "ppo"], help="which bundled config to use")
    p.add_argument("--target-j", type=float, default=0.6, help="J* (default 0.6: the bundled job's mid-way J)")
    p.add_argument("--b-train", default="", help="candidate B_train list, e.g. 64,128,256,512 "
                   "(default: the job's B_train x 1/2, 1, 2, 4)")
    p.add_argument("--b-gen", default="auto", help="stage-2 B_gen list, or auto (1, 2, 4, 8 x B_train)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per configuration (S..S+K-1)")
    p.add_argument("--first-seed", type=int, default=0, help="S: the first run.seed")
    p.add_argument("--n-max", type=int, default=0, help="response budget per curve (default: the job's)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every this many responses "
                   "(default: the largest candidate B_train)")
    p.add_argument("--full-curves", action="store_true", help="run every curve to N_max, not only to J*")
    p.add_argument("--fixed-lr", action="store_true", help="add the fixed-LR control at the largest B_train")
    p.add_argument("--delta", type=float, default=0.1, help="q plateau: within delta of the best q")
    p.add_argument("--kv-bytes", type=int, default=0, help="emulate a device with this many bytes of KV cache")
    p.add_argument("--recheck", type=int, default=1, help="async configurations re-checked for J on every seed")
    p.add_argument("--confirm-seeds", type=int, default=3, help="fresh seeds for chosen vs job (0: skip)")
    p.add_argument("--budget-s", type=float, default=0.0, help="start no run after this many seconds")
    p.add_argument("--clock", default="auto", choices=["auto", "wall", "cpu"],
                   help="what T measures: wall seconds, or process CPU seconds (auto: cpu for a CPU job, "
                   "so other processes' load on a shared machine stays out of T)")
    p.add_argument("--resume", action="store_true", help="reuse the finished runs already in --out")
    p.add_argument("--out", default="runs/tune", help="output directory")
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser("report", help="Table 1, grad-norm slope and figures from existing run directories")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories, or folders of them")
    p.add_argument("--target-j", type=float, required=True, help="J*")
    p.add_argument("--reference", default="", help="reference configuration label (default: the first run's)")
    p.add_argument("--delta", type=float, default=0.1, help="q plateau tolerance for the B_gen figure")
    p.add_argument("--out", default=None, help="write report.md, report.json and figures/ here")
    p.set_defaults(func=_cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "command", None) == "train":
        args.overrides = unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from rlengine.config import ConfigError
    from rlengine.model.loader import CheckpointError
    from rlengine.rl.rewards import RewardError

    try:
        return args.func(args)
    except (RewardError, ConfigError, CheckpointError) as exc:
        # the user's input (or reward function), not a bug: no traceback of ours, printed by one rank
        if _rank() == 0:
            print(f"rlengine {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _rank() -> int:
    """This process's rank under torchrun (0 alone): only rank 0 prints a user error every rank hit."""
    import os

    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    sys.exit(main())
