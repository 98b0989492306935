"""The `rlengine` command line: one subcommand per job, each parsed here and run by its module.

Library code never parses argv; this file is the only place that does. Imports are lazy so
`rlengine --help` is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from rlengine.cli.info import cmd_info as _cmd_info
from rlengine.cli.export import add_export_parser
from rlengine.cli.serve import add_serve_parser
from rlengine.cli.tune import cmd_report as _cmd_report
from rlengine.cli.tune import cmd_tune as _cmd_tune


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset name (see `rlengine info`), HF checkpoint directory, or "
                   "Hugging Face hub id org/name (cached or downloaded; a preset of the same spelling wins)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")


def _add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    """--tokenizer / --revision: what an engine's model and tokenizer files are (generate and serve)."""
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer files from DIR or a hub id (default: the checkpoint's own, or the built-in one "
                   "for presets)")
    p.add_argument("--revision", default=None, help="with a hub id --model: the branch, tag or commit sha")
    p.add_argument("--lora-path", default=None, metavar="DIR", help="a PEFT LoRA adapter to decode with, unmerged")


def _add_job_args(p: argparse.ArgumentParser) -> None:
    """--config / --algo: which RL job (train and tune)."""
    p.add_argument("--config", default=None, help="the job's TOML file, or a packaged config name such as gsm8k "
                   "(default: the bundled grpo/ppo config)")
    p.add_argument("--algo", default=None, choices=["grpo", "ppo"], help="which bundled config to use (default: grpo)")


def _cmd_demo(args) -> int:
    from rlengine.model.config import ConfigError
    from rlengine.model.demo import run_demo
    from rlengine.model.factory import tokenizer_for
    from rlengine.plan.preflight import check_device, check_model

    check_device(args.device, "--device")
    check_model(args.model, "--model")
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not tokenizer_for(args.model).encode(args.prompt):
        raise ConfigError(f"--prompt {args.prompt!r} encodes to no tokens; give a non-empty prompt")
    run_demo(model=args.model, dtype=args.dtype, device=args.device, prompt=args.prompt,
             max_tokens=args.max_tokens)
    return 0


def _cmd_generate(args) -> int:
    """Text in, text out through the engine (LLM.generate / LLM.chat); prints each completion's text."""
    from rlengine.model.config import ConfigError
    from rlengine.engine import LLM, SamplingParams
    from rlengine.model.factory import tokenizer_for
    from rlengine.plan.preflight import check_device, check_model

    check_device(args.device, "--device")
    check_model(args.model, "--model", args.revision)
    # --tokenizer: a DIR or hub id with tokenizer files that fit the model's vocabulary; else the checkpoint's own,
    # or the built-in one if it fits
    tokenizer_for(args.model, revision=args.revision, tokenizer=args.tokenizer, what="--tokenizer")
    if args.system is not None and not args.chat:
        raise ConfigError("--system needs --chat (a system turn is part of the chat template)")
    for flag, value in (("--max-tokens", args.max_tokens), ("--n", args.n)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if args.seed is not None and args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                                max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or None)
    except ValueError as exc:
        raise ConfigError(f"{exc} (check --temperature / --top-p / --seed / --stop)") from None
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, tokenizer=args.tokenizer, revision=args.revision,
              lora_path=args.lora_path)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
        messages.append({"role": "user", "content": args.prompt})
        # no template: ChatTemplateError, a ConfigError naming the checkpoint
        ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    else:
        ids = llm.tokenizer.encode(args.prompt, add_special_tokens=True)
    if not ids:
        raise ConfigError(f"--prompt {args.prompt!r} encodes to no tokens; give a non-empty prompt")
    if len(ids) >= llm.max_model_len:
        raise ConfigError(f"--prompt is {len(ids)} tokens, which leaves no room to generate "
                          f"(the model's max_model_len is {llm.max_model_len})")
    out = llm.chat(messages, params) if args.chat else llm.generate([args.prompt], params)
    for completion in out[0].outputs:
        print(completion.text)
    return 0


def _cmd_train(args) -> int:
    from rlengine.rl.trainer.loop import Trainer
    from rlengine.rl.trainer.signals import InterruptStart, StartInterrupted

    if args.nproc is not None or args.nnodes > 1:
        return _launch(args)
    # --resume: the run's own config; only overrides that keep its meaning apply (RESUME_OVERRIDABLE)
    cfg = _train_config(args)
    if os.environ.get("RANK", "0") == "0":
        print(f"run directory: {cfg.run_dir}", flush=True)
    try:
        with InterruptStart():  # before the first update a signal has nothing to finish: stop at once
            trainer = Trainer(cfg, resume_from=args.resume, profile=args.profile,
                              profile_window=args.profile_window)
    except StartInterrupted as exc:
        if os.environ.get("RANK", "0") == "0":
            print(_start_interrupted(exc, Path(cfg.run_dir)), file=sys.stderr)
        return 130
    history = trainer.run()
    ranks = trainer.dist.enabled
    trainer.dist.close()
    code = _train_summary(trainer, history)
    if ranks:  # a rank of a multi-rank job, its work done and saved: exit without the interpreter's teardown,
        # where gloo's C++ threads can still abort the process (std::terminate) after a finished job
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _start_interrupted(exc, run_dir: Path) -> str:
    """The one line for a stop signal before the first update (no checkpoint yet)."""
    if (run_dir / "config.json").is_file():
        return (f"{exc}: interrupted before the first update (no checkpoint yet); start it over with: "
                f"rlengine train --resume {run_dir}")
    return f"{exc}: interrupted while setting up; nothing was written: run the same command again"


def _train_summary(trainer, history) -> int:
    """Rank 0 prints J against N and the run directory; the exit code (130: interrupted)."""
    if not trainer.dist.is_main:
        return 130 if trainer.interrupted else 0
    if trainer.interrupted:
        print(f"interrupted at update {trainer.update}; resume with: rlengine train --resume {trainer.run_dir}",
              file=sys.stderr)
        return 130
    js = [(r["N"], r["J"]) for r in history if r.get("J") is not None]
    print("J against N (held-out accuracy):")
    for n, j in js:
        print(f"  N={n:6d}  J={j:.3f}")
    print(f"run directory: {trainer.run_dir}")
    return 0


def _train_config(args):
    """The config `rlengine train` would run, validated against this machine and the job's files
    (rlengine.plan.preflight), without building anything: every user error surfaces here."""
    from importlib import resources

    from rlengine.model.config import ConfigError
    from rlengine.plan.preflight import check_train_config
    from rlengine.rl.config import load_job_config, split_overrides
    from rlengine.rl.trainer.run_dir import check_new_run, check_out_dir, fresh_run_dir, resume_config
    from rlengine.telemetry.profiler import ProfileWindow

    try:
        ProfileWindow.parse(args.profile_window)
    except ValueError as exc:
        raise ConfigError(f"--profile-window: {exc}") from None
    if args.resume:
        given = [flag for flag, value in (("--config", args.config), ("--algo", args.algo)) if value is not None]
        if given:  # the job is the run's own (RUN_DIR/config.json): another one cannot be honoured
            raise ConfigError(f"{' and '.join(given)} cannot be used with --resume: a resume continues the job "
                              f"saved in {Path(args.resume) / 'config.json'}")
        cfg = resume_config(args.resume, args.overrides)
    else:
        cfg = load_job_config(args.config or str(resources.files("rlengine") / "configs" / f"{args.algo or 'grpo'}.toml"),
                          args.overrides)
        if any(key == "run.out_dir" for key, _ in split_overrides(args.overrides)):
            check_new_run(Path(cfg.run_dir), cfg.run.overwrite)  # named by the user: never replaced silently
        elif not cfg.run.overwrite and "RANK" not in os.environ:  # ranks get the launcher's choice explicitly
            fresh = str(fresh_run_dir(cfg.run_dir))  # runs/default, then runs/default-1, ...
            if fresh != cfg.run_dir:  # as if the user had named it (the config itself stays frozen)
                cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=fresh))
    check_train_config(cfg)
    check_out_dir(cfg.run_dir)  # a file, a path under one, a read-only directory: one line before anything runs
    return cfg


def _cmd_config(args) -> int:
    """`rlengine config show`: the job's every field with value, default and doc (rlengine.rl.config.show)."""
    from importlib import resources

    from rlengine.rl.config import load_job_config
    from rlengine.rl.config.show import field_rows, format_rows

    cfg = load_job_config(args.config or str(resources.files("rlengine") / "configs" / f"{args.algo or 'grpo'}.toml"),
                      args.overrides)
    print("\n".join(format_rows(field_rows(cfg))))
    print("(* = differs from the built-in defaults; override any field with --section.field VALUE)")
    return 0


def _cmd_plot(args) -> int:
    """`rlengine plot RUN_DIR...` (rlengine.plots.runs), or one benchmark / tune JSON with --kind."""
    from rlengine.model.config import ConfigError
    from rlengine.plots import draw

    try:
        paths = draw(args.kind, args.paths, args.out, x=args.x, y=args.y, group=args.group)
    except (ImportError, ValueError) as exc:  # no matplotlib; a path, record or field, named in the message
        raise ConfigError(str(exc)) from None
    print("\n".join(f"wrote {p}" for p in paths))
    return 0


def _launch(args) -> int:
    from rlengine.cli.launch import launch

    return launch(args, _train_config)


def _cmd_bench(args) -> int:
    import importlib

    from rlengine.benchmarks import BENCHMARKS, MODULES

    if args.name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {args.name!r}; choose from {', '.join(BENCHMARKS)}")
    return importlib.import_module(MODULES[args.name]).main(args.args) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlengine", description="Single-process RL engine for LLMs.")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("info", help="show presets, devices and whether the C++ extension is built")
    p.add_argument("--plan", default=None, metavar="CONFIG",
                   help="print the per-device memory plan (and B_KV) of a training config instead; dotted "
                   "overrides apply to it (--plan gsm8k --model.name DIR)")
    p.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                   help="device memory for --plan in GiB (default: this CUDA device's, else this machine's RAM)")
    p.add_argument("--kernels", default=None, metavar="PRESET",
                   help="time and print the CPU kernel choices of a preset's decode shapes and prefill attention")
    p.add_argument("--kernels-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="dtype for --kernels (default: %(default)s)")
    p.add_argument("--cpu-kernels", default="cache", metavar="SETTING",
                   help="for --kernels: cache | measure | torch | skinny | TABLE.json (default: %(default)s)")
    p.add_argument("--save", default=None, metavar="PATH", help="for --kernels: write the table (a .json to pin)")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("demo", help="greedy generation from a preset or checkpoint through the plain forward")
    _add_model_args(p)
    p.add_argument("--prompt", default="12+34=", help="prompt text (built-in tokenizer for presets)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("generate", help="generate text from a checkpoint (or preset) through the engine",
                       description="Text in, text out through the vLLM-style engine: --chat applies the "
                       "checkpoint's chat template (with an optional --system turn); prints each completion.")
    _add_model_args(p)
    p.add_argument("--prompt", required=True, help="prompt text (with --chat: the user message)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--n", type=int, default=1, help="completions to print")
    p.add_argument("--seed", type=int, default=None)
    _add_tokenizer_args(p)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.set_defaults(func=_cmd_generate)

    add_serve_parser(sub, _add_model_args, _add_tokenizer_args)
    add_export_parser(sub)

    p = sub.add_parser("train", help="run GRPO/PPO (default: GRPO on a built-in task with the tiny preset)",
                       description="Run an RL job. With no arguments: the embedded default (GRPO, tiny preset, "
                       "built-in first-digit task, CPU if no GPU). Override any config field with dotted "
                       "options, e.g. --train.b_train 256 --gen.b_gen 512.")
    _add_job_args(p)
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    p.add_argument("--nproc", type=int, default=None, metavar="K",
                   help="run K ranks on this node (torchrun; one device each, gloo on CPU, nccl on CUDA)")
    p.add_argument("--nnodes", type=int, default=1, metavar="N",
                   help="with --nproc: nodes in the job; run the same command on each (default 1)")
    p.add_argument("--node-rank", type=int, default=0, metavar="R", help="with --nnodes: this node's rank")
    p.add_argument("--master-addr", default="127.0.0.1", metavar="A", help="with --nnodes: node 0's address")
    p.add_argument("--master-port", type=int, default=29500, metavar="P", help="with --nnodes: a free port on node 0")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write a torch.profiler trace (Chrome / Perfetto JSON) of --profile-window updates to DIR")
    p.add_argument("--profile-window", default="1:2", metavar="START:STOP",
                   help="RL updates to record (0-based; update START-1 is the profiler's warm-up)")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("config", help="show every config field of a job: value, default and what it means",
                       description="`rlengine config show [--config X] [--section.field VALUE ...]` prints every "
                       "field of the job's config (file plus overrides) with its value, default and one line of doc.")
    p.add_argument("action", choices=["show"], help="what to do (show)")
    _add_job_args(p)
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("plot", help="PNG figures of runs (J, reward, length, KL, grad norm vs N and time)",
                       description="`rlengine plot RUN_DIR...` draws metrics_vs_N.png and metrics_vs_time.png from "
                       "each run's metrics.jsonl, runs overlaid (needs matplotlib: the plot extra). --kind KIND FILE "
                       "draws a benchmark JSON (decode, asymmetry, ttt, sweep, serve) or a tune report.json.")
    p.add_argument("paths", nargs="+", metavar="RUN_DIR", help="run directories (or one JSON file with --kind)")
    p.add_argument("-o", "--out", default=None, help="output directory for runs (default: the run directory, or "
                   "plots/ for several runs); the PNG path for --kind")
    from rlengine.plots import KINDS

    p.add_argument("--kind", default="runs", choices=KINDS, help="what the paths are (default: runs)")
    p.add_argument("--x", default=None, help="--kind sweep: x column")
    p.add_argument("--y", default=None, help="--kind sweep: comma-separated y columns")
    p.add_argument("--group", default=None, help="--kind sweep: columns that tell lines apart")
    p.set_defaults(func=_cmd_plot)

    from rlengine.benchmarks import BENCHMARKS

    p = sub.add_parser("bench", help="run a benchmark: " + "; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()),
                       description="\n".join(f"{k}: {v}" for k, v in BENCHMARKS.items()) +
                       "\n`rlengine bench NAME --help` shows a benchmark's options.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=list(BENCHMARKS), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="options passed to the benchmark")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("tune", help="Algorithm 1 (docs/METHOD.md): the B_train / B_gen that reach a target J soonest",
                       description="Stage 1: sample-matched curves per B_train with the sqrt LR rule (r_N at J*); "
                       "stage 2: raise B_gen until q plateaus or B_KV; choose max q / r_N; confirm against the "
                       "job on fresh seeds; write report.md, report.json, chosen.toml, runs.jsonl, figures/.")
    _add_job_args(p)
    p.add_argument("--target-j", type=float, default=0.6, help="J* (default 0.6: the bundled job's mid-way J)")
    p.add_argument("--b-train", default="", help="candidate B_train list, e.g. 64,128,256,512 "
                   "(default: the job's B_train x 1/2, 1, 2, 4)")
    p.add_argument("--b-gen", default="auto", help="stage-2 B_gen list, each > the job's B_train, or auto "
                   "(1, 2, 4, 8 x B_train)")
    p.add_argument("--probe-updates", type=int, default=12, help="updates per stage-2 throughput probe")
    p.add_argument("--probe-skip", type=int, default=2, help="leading probe updates left out of q (more when "
                   "B_gen / B_train is larger: the pipeline fill)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for every run (fixed and recorded)")
    p.add_argument("--workers", default="auto", help="runs at once, each its own process (auto: 2 for a CPU job "
                   "on >= 2 x --threads cores, else 1; a GPU job runs one at a time)")
    p.add_argument("--no-retune", action="store_true", help="no LR bracket for candidates with r_N > 1 + eps")
    p.add_argument("--predict", default=None, metavar="DEVICE", help="print the Eq. 5 B_gen knee of the job on "
                   "DEVICE (H100, H200, cpu: measured now, with this machine's decode-step and learner costs, or a "
                   "`rlengine bench ceilings` JSON) and exit")
    p.add_argument("--predict-context", type=int, default=0, help="--predict: context length S (default: "
                   "gen.max_tokens)")
    p.add_argument("--predict-b-max", type=int, default=4096, help="--predict: largest B considered (B_KV)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per configuration (S..S+K-1)")
    p.add_argument("--first-seed", type=int, default=0, help="S: the first run.seed")
    p.add_argument("--n-max", type=int, default=0, help="response budget per curve (default: the job's)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every this many responses "
                   "(default: ~N_max / 100, a multiple of the largest candidate B_train)")
    p.add_argument("--full-curves", action="store_true", help="run every curve to N_max, not only to J*")
    p.add_argument("--fixed-lr", action="store_true", help="add the fixed-LR control at the largest B_train")
    p.add_argument("--delta", type=float, default=0.1, help="q plateau: within delta of the best q")
    p.add_argument("--kv-bytes", type=int, default=0, help="emulate a device with this many bytes of KV cache")
    p.add_argument("--recheck", type=int, default=1, help="async configurations re-checked for J on every seed")
    p.add_argument("--confirm-seeds", type=int, default=16, help="cap on the fresh seed pairs of chosen vs coupled "
                   "best, added one pair at a time until a 95%% confidence sequence is decisive (0: skip)")
    p.add_argument("--min-effect", type=float, default=0.1, help="the confirmation stops once its interval lies "
                   "within 1 +- this (an effect too small to report)")
    p.add_argument("--budget-s", type=float, default=0.0, help="start no run after this many seconds")
    p.add_argument("--clock", default="auto", metavar="auto|wall|cpu|TABLE.json",
                   help="what T measures: wall seconds, or process CPU seconds (auto: cpu for a CPU job, "
                   "so other processes' load on a shared machine stays out of T), or a device clock: a cost "
                   "table (`rlengine bench costs`) that re-costs each run's step trace (the runs still time "
                   "themselves on auto)")
    p.add_argument("--resume", action="store_true", help="reuse the finished runs already in --out")
    p.add_argument("--out", default="runs/tune", help="output directory")
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser("report", help="Table 1, grad-norm slope and figures from existing run directories")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories, or folders of them")
    p.add_argument("--target-j", type=float, required=True, help="J*")
    p.add_argument("--reference", default="", help="reference configuration label (default: the first run's)")
    p.add_argument("--delta", type=float, default=0.1, help="q plateau tolerance for the B_gen figure")
    p.add_argument("--clock", default=None, metavar="TABLE.json", help="a device clock: re-cost each run's T "
                   "from its step trace with this cost table (`rlengine bench costs`; default: the runs' own clock)")
    p.add_argument("--out", default=None, help="write report.md, report.json and figures/ here")
    p.set_defaults(func=_cmd_report)
    for p in sub.choices.values():  # `rlengine CMD --debug` too (SUPPRESS: an absent flag keeps the global one)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


DEBUG_HELP = "show the traceback of a user error too (bugs always show theirs)"


def _user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that mean "the user's input is wrong" (a config value, a file, a data row, a
    checkpoint, a reward function): one line, exit code 2. Every other exception is a bug."""
    from rlengine.model.config import ConfigError  # DatasetError is a ConfigError
    from rlengine.model.loader import CheckpointError
    from rlengine.rl.data.rewards import RewardError

    return ConfigError, CheckpointError, RewardError


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A user error prints `rlengine CMD: error: MESSAGE` as the last stderr line
    (rank 0 only) and returns 2; the lines of a multi-line message after its first (a failing reward
    function's traceback, the list of prompts that do not fit) are printed above it. Bugs propagate."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "command", None) in ("train", "config", "info", "tune"):  # dotted --section.field overrides
        args.overrides = unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if getattr(args, "command", None) == "bench" and "--debug" in args.args:  # REMAINDER swallows it
        args.args.remove("--debug")
        args.debug = True
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except _user_errors() as exc:
        if _rank() == 0:
            command = f"bench {args.name}" if args.command == "bench" else args.command
            _report(command, exc, debug=args.debug)
        return 2


def _report(command: str, exc: BaseException, *, debug: bool) -> None:
    """A user error on stderr: (with --debug our traceback,) any detail lines, then one summary line."""
    import traceback

    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    first, *rest = str(exc).strip().splitlines() or [type(exc).__name__]
    for line in rest:
        print(f"  {line}", file=sys.stderr)
    tail = " (details above)" if rest else ""
    print(f"rlengine {command}: error: {first.rstrip(': ')}{tail}", file=sys.stderr)


def _rank() -> int:
    """This process's rank under torchrun (0 alone): only rank 0 prints a user error every rank hit."""
    import os

    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    sys.exit(main())
