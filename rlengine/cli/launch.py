"""`rlengine train --nproc K` (and --nnodes): K ranks of the same train command through torch's elastic
launcher (what torchrun runs), and what to say when one of them fails.

The CLI (cli.py) parses the arguments and passes its config builder; the config is checked here, in
the launcher's process, so a bad config gives one error and starts no rank.
"""

from __future__ import annotations

import sys


def launch(args, train_config) -> int:
    """`rlengine train --nproc K`: check the config here (one clear error, no process started), then
    start K ranks of the same command through torch's elastic launcher (what torchrun runs)."""
    from torch.distributed.run import get_args_parser, run

    from rlengine.model.config import ConfigError

    args.nproc = 1 if args.nproc is None else args.nproc  # --nnodes alone: one rank per node
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--nnodes must be >= 1 and --node-rank in [0, {args.nnodes}), got --nnodes "
                          f"{args.nnodes} --node-rank {args.node_rank}")
    cfg = train_config(args)
    check_host_memory(cfg, args.nproc, args.nproc * args.nnodes)
    argv = ["train"] + (["--config", args.config] if args.config else []) + (["--algo", args.algo] if args.algo else [])
    argv += (["--resume", args.resume] if args.resume else []) + list(args.overrides)
    argv += [] if args.resume else ["--run.out_dir", cfg.run_dir]  # every rank writes where this one chose
    argv += ["--profile", args.profile, "--profile-window", args.profile_window] if args.profile else []  # rank 0 writes
    # one node: torchrun --standalone; several: every node's launcher meets at --master-addr:port
    # (torchrun's static rendezvous, a c10d store on node 0), node ranks as given
    where = ["--standalone"] if args.nnodes == 1 else [
        "--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank), "--master-addr", args.master_addr,
        "--master-port", str(args.master_port)]
    # a SIGTERM / SIGINT here reaches every rank: each finishes its update, saves and exits 130 (in the grace)
    launcher = get_args_parser().parse_args(["--nproc-per-node", str(args.nproc), *where, "--shutdown-timeout",
                                             str(int(2 * cfg.run.dist_timeout_s) + 30), "-m", "rlengine", *argv])
    import logging  # torch's elastic agent sets each of its loggers' level: its shutdown notes are noise here

    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.ERROR)
    # its "failed (exitcode: N)" per rank too: the job's own last line says how each rank ended, in words
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    from rlengine.cli.rank_watch import RankWatch

    # a stopped rank fails no collective: killed after half the collective timeout, the job ends within it
    watch = RankWatch(cfg.run.dist_timeout_s / 2)
    try:
        with watch:
            run(launcher)
    except Exception as exc:  # noqa: BLE001 - a rank failed: it printed its own error; say which, once
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if isinstance(exc, SignalException):
            return 130
        if not isinstance(exc, ChildFailedError):
            raise
        if reported_user_error(exc.failures, watch.killed):  # rank 0's one line is the job's: exit 2 as it did
            return 2
        print(f"rlengine train: {failure_line(exc.failures, watch.killed)}", file=sys.stderr)
        return 1
    return 0


def check_host_memory(cfg, nproc: int, world: int) -> None:
    """CPU ranks share this host: refuse, before any rank starts, a job whose per-rank memory plan
    (each of the nproc ranks gets an equal share of the available RAM) does not fit; the ranks plan
    with the same share (plan/memory.py's RANK_MEMORY_ENV). GPU ranks each plan their own device."""
    import os

    import torch

    from rlengine.model.config import ConfigError

    if torch.cuda.is_available() or cfg.model.device not in ("auto", "cpu"):
        return
    from rlengine.plan.memory import RANK_MEMORY_ENV, host_memory_per_rank, job_shape, plan_job

    share, _ = host_memory_per_rank(nproc, own=False)
    try:
        plan_job(cfg, job_shape(cfg), device_bytes=share, device_type="cpu", world_size=world)
    except ConfigError as exc:
        raise ConfigError(f"--nproc {nproc} on this host: {exc}") from None
    os.environ[RANK_MEMORY_ENV] = str(share)  # the ranks inherit it


def root_causes(failures: dict, stopped: dict[int, float]) -> list[int]:
    """The ranks that caused a failure, most telling first: a rank found stopped; one killed by a signal
    the launcher does not send; one that exited on its own (after a peer died, the others exit with
    errors too); else all."""
    import signal

    killed = {r for r, f in failures.items() if f.exitcode < 0 and f.exitcode != -signal.SIGTERM}
    exited = {r for r, f in failures.items() if f.exitcode != -signal.SIGTERM}
    return sorted(next(s for s in (set(stopped) & set(failures), killed, exited, set(failures)) if s))


def reported_user_error(failures: dict, stopped: dict[int, float]) -> bool:
    """Whether the job ended on a user error that rank 0 has already reported in its one line: every
    rank that caused the failure exited with code 2 (a ConfigError, CheckpointError or RewardError: the
    ranks agree on those, and only rank 0 prints them), rank 0 among them or ended by the launcher's
    SIGTERM after its line (the ranks exit from the same point, in either order)."""
    import signal

    causes = root_causes(failures, stopped)
    return (not stopped and 0 in failures and failures[0].exitcode in (2, -signal.SIGTERM)
            and all(failures[r].exitcode == 2 for r in causes))


def failure_line(failures: dict, stopped: dict[int, float]) -> str:
    """One line: the ranks that caused the failure and how they ended, then the others.

    failures: {rank: ProcessFailure (.exitcode)}; stopped: {rank: seconds} of ranks the launcher killed
    because they had been stopped that long."""
    def how(rank: int) -> str:
        if rank in stopped:
            return f"stopped (SIGSTOP or frozen) for {stopped[rank]:.0f} s, so the launcher killed it"
        return how_it_ended(failures[rank].exitcode)
    causes = root_causes(failures, stopped)
    line = "; ".join(f"rank {r} {how(r)}" for r in causes) + "; the job was stopped"
    others = sorted(set(failures) - set(causes))
    return line + (f" (ended with it: rank{'s' * (len(others) > 1)} {', '.join(map(str, others))})"
                   if others else "")


def how_it_ended(exitcode: int) -> str:
    """A rank's exit code in words: a negative one is the signal that killed it."""
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    import signal

    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    if -exitcode == signal.SIGKILL:
        return f"killed by {name}, likely out of memory (the kernel's OOM killer sends it)"
    return f"stopped by {name}"
