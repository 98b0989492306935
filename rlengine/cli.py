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

    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    print(f"C++ extension: {'built' if _ext.AVAILABLE else 'not built (' + str(_ext.LOAD_ERROR) + ')'}")
    if _ext.AVAILABLE:
        cuda_ops = [op for op in _ext.CPP_OPS if _ext.has_cuda_op(op)]
        print(f"  CPU ops: {', '.join(op for op in _ext.CPP_OPS if _ext.has_op(op))}")
        print(f"  CUDA ops: {', '.join(cuda_ops) if cuda_ops else 'none (a CPU build of torch, or no nvcc)'}")
    from rlengine.engine.attention import BACKENDS

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"attention backends on {device}:")
    for name, cls in BACKENDS.items():
        reason = cls.unavailable_reason(device) if hasattr(cls, "unavailable_reason") else None
        print(f"  {name:10s} {'available' if reason is None else 'unavailable: ' + reason}")
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
    from importlib import resources

    from rlengine.rl.config import load_config, resume_config
    from rlengine.rl.trainer import Trainer

    if args.resume:
        # the run's own config; only overrides that keep its meaning apply (config.RESUME_OVERRIDABLE)
        cfg = resume_config(args.resume, args.overrides)
        trainer = Trainer(cfg, resume_from=args.resume)
    else:
        path = args.config
        if path is None:
            path = str(resources.files("rlengine") / "configs" / f"{args.algo}.toml")
        cfg = load_config(path, args.overrides)
        trainer = Trainer(cfg)
    history = trainer.run()
    js = [(r["N"], r["J"]) for r in history if r.get("J") is not None]
    print("J against N (held-out accuracy):")
    for n, j in js:
        print(f"  N={n:6d}  J={j:.3f}")
    print(f"run directory: {trainer.run_dir}")
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
    p.set_defaults(func=_cmd_train)

    from rlengine.benchmarks import BENCHMARKS

    p = sub.add_parser("bench", help="run a benchmark: " + "; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()),
                       description="\n".join(f"{k}: {v}" for k, v in BENCHMARKS.items()) +
                       "\n`rlengine bench NAME --help` shows a benchmark's options.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=list(BENCHMARKS), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="options passed to the benchmark")
    p.set_defaults(func=_cmd_bench)
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
    except RewardError as exc:  # the user's reward function failed too often: its first traceback, no ours
        print(f"rlengine {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (ConfigError, CheckpointError) as exc:  # the user's input, not a bug: one line, no traceback
        print(f"rlengine {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
