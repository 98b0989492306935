"""`rlengine tune` (Algorithm 1 of docs/METHOD.md, rlengine.tune; with --predict the job's B_gen knee) and
`rlengine report` (the same accounting over existing run directories). The CLI's other commands are in
cli.py, which builds the parsers."""

from __future__ import annotations

import sys
from pathlib import Path


def _int_list(text: str, what: str) -> tuple[int, ...]:
    from rlengine.model.config import ConfigError

    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{what} must be a comma-separated list of integers, got {text!r}") from None


def cmd_tune(args) -> int:
    """Algorithm 1 of docs/METHOD.md (rlengine.tune): stage 1, stage 2, choice, confirmation, report in --out.
    Dotted --section.field overrides change the job first, as for `train`; --predict only prints
    the Eq. 5 B_gen knee for the job on a device and starts no run."""
    from importlib import resources

    from rlengine.model.config import ConfigError
    from rlengine.plan.preflight import check_train_config
    from rlengine.rl.config import load_job_config
    from rlengine.tune import TuneSpec, tune
    from rlengine.tune.runner import parse_workers
    from rlengine.rl.trainer.signals import InterruptStart, StartInterrupted

    if not 0 < args.target_j <= 1:  # J is an accuracy
        raise ConfigError(f"--target-j must be in (0, 1] (J is held-out accuracy), got {args.target_j}")
    path = args.config or str(resources.files("rlengine") / "configs" / f"{args.algo or 'grpo'}.toml")
    cfg = load_job_config(path, args.overrides)
    check_train_config(cfg)
    job = cfg.to_dict()
    b = job["train"]["b_train"]
    if args.predict:
        return _tune_predict(job, args)
    clock, table = (args.clock, "") if args.clock in ("auto", "wall", "cpu") else ("auto", args.clock)
    if table:
        _load_clock(table)  # a bad table is one line before any run starts
    auto_gen = args.b_gen == "auto"
    b_gen = () if auto_gen else _int_list(args.b_gen, "--b-gen")
    small = [v for v in b_gen if v <= b]
    if small:
        raise ConfigError(f"--b-gen {args.b_gen}: {small} <= the job's B_train {b}; stage 2 raises B_gen above "
                          f"B_train (B_gen = B_train is always probed), give values > {b}")
    try:
        spec = TuneSpec(job=job, target_j=args.target_j,
                        b_train=(_int_list(args.b_train, "--b-train") if args.b_train
                                 else (b // 2, b, 2 * b, 4 * b)),
                        seeds=tuple(range(args.first_seed, args.first_seed + args.seeds)), n_max=args.n_max,
                        eval_every=args.eval_every,
                        stop_at_target=not args.full_curves, fixed_lr=args.fixed_lr,
                        b_gen=b_gen, explicit_b_gen=not auto_gen, probe_updates=args.probe_updates,
                        probe_skip=args.probe_skip, plateau_delta=args.delta, kv_bytes=args.kv_bytes,
                        recheck=args.recheck, confirm_seeds=args.confirm_seeds, budget_s=args.budget_s,
                        clock=clock, cost_table=table, min_effect=args.min_effect, threads=args.threads,
                        retune=not args.no_retune,
                        workers=parse_workers(args.workers, job, args.threads))
    except ConfigError:
        raise
    except ValueError as exc:  # TuneSpec's checks of the options
        raise ConfigError(str(exc)) from None
    try:
        with InterruptStart():  # outside a run's own handler a signal stops the tune at once
            result = tune(spec, args.out, resume=args.resume)
    except (KeyboardInterrupt, StartInterrupted):
        print(f"rlengine tune: interrupted; finished runs are kept in {args.out}: continue with the same command "
              "and --resume", file=sys.stderr)
        return 130
    print(f"chosen: {result.chosen or 'none'}; report: {args.out}/report.md")
    return 0


def _tune_predict(job: dict, args) -> int:
    """`tune --predict DEVICE`: Eq. 5's critical B_gen for the job (rlengine.tune.predict); prints and exits."""
    import json

    from rlengine.tune.predict import device_ceilings, format_prediction, job_model_config, predict_knee

    dtype = job["model"]["dtype"] if args.predict == "cpu" or args.predict.endswith(".json") else "bfloat16"
    context = args.predict_context or job["gen"]["max_tokens"]
    table = Path(args.predict)
    if table.suffix == ".json" and table.is_file() and '"rlengine.cost_table/' in table.read_text()[:200]:
        from rlengine.tune.step_costs import format_table_knee, table_knee

        clock = _load_clock(args.predict)  # the knee on the table the device clock re-costs with
        knee = table_knee(clock.table, job, path=args.predict, context=context, delta=args.delta,
                          b_max=args.predict_b_max)
        print(format_table_knee(knee, job["train"]["b_train"]))
        return 0
    costs = None
    if args.predict == "cpu":  # the engine's and learner's own costs on this CPU, at the tune's thread count
        import torch

        from rlengine.tune.step_costs import measure_step_costs

        torch.set_num_threads(args.threads)
        costs = measure_step_costs(job)
    p = predict_knee(job_model_config(job), device_ceilings(args.predict), context_len=context, dtype=dtype,
                     delta=args.delta, b_max=args.predict_b_max, costs=costs)
    print(format_prediction(p, job["train"]["b_train"]))
    if args.out and args.out != "runs/tune":
        import dataclasses

        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "predict.json").write_text(json.dumps(dataclasses.asdict(p), indent=1))
    return 0


def _load_clock(path: str):
    """The DeviceClock of a cost-table file (a ConfigError naming the file when it is not one)."""
    from rlengine.model.config import ConfigError
    from rlengine.tune.clock import DeviceClock

    if not Path(path).is_file():
        raise ConfigError(f"--clock {path}: not auto, wall, cpu or a cost-table file (`rlengine bench costs` writes one)")
    try:
        return DeviceClock.load(path)
    except ValueError as exc:
        raise ConfigError(f"--clock {path}: {exc}") from None


def cmd_report(args) -> int:
    """Table 1 and figures from existing run directories (rlengine.tune.report_runs)."""
    from rlengine.model.config import ConfigError
    from rlengine.tune import report_runs
    from rlengine.tune.report import table_markdown, write_runs_report

    if not 0 < args.target_j <= 1:
        raise ConfigError(f"--target-j must be in (0, 1] (J is held-out accuracy), got {args.target_j}")
    clock = _load_clock(args.clock) if args.clock else None
    try:
        result = report_runs(args.runs, args.target_j, reference=args.reference, delta=args.delta, clock=clock)
    except ValueError as exc:  # report_runs' checks of the run directories (and their traces)
        raise ConfigError(str(exc)) from None
    own = ", ".join(sorted({c.clock for c in result.curves}))
    print(f"clock: {clock.label}" if clock is not None else f"clock: the runs' own ({own})")
    if clock is not None:
        for r in result.clock["runs"]:
            print(f"  {r['run']}: T on its own clock {r['t_measured']:.3f} s, on the device clock {r['t_clock']:.3f} s "
                  f"({r['t_clock'] / r['t_measured'] - 1:+.1%})")
    print(table_markdown(result.rows, result.reference))
    print(f"best: {result.chosen or 'none'}")
    for note in result.notes:
        print(f"note: {note}")
    if args.out:
        print(f"report: {write_runs_report(result, args.out)}")
    return 0
