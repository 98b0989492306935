"""Options and validation shared by the installed benchmarks, run right after argparse.

add_model_options declares the model options every model benchmark takes; HelpFormatter shows
every option's default in --help. Each benchmark's main(argv) calls check_args before building
a model: a bad option is a ConfigError naming the option (one line from `rlengine bench NAME`,
exit code 2), never a traceback from deep inside the sweep.
"""

from __future__ import annotations

import argparse

import torch

from rlengine.model.config import DTYPES, ConfigError
from rlengine.plan.preflight import check_backend, check_device


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and "(default: X)" after each option's help (lists as a,b,c),
    unless the help already says its default or there is none to show (None, False)."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def add_model_options(p: argparse.ArgumentParser, *, dtypes=tuple(DTYPES), model_help: str = "preset name") -> None:
    """--model (default qwen3-30m, the CPU decode benchmark shape), --dtype, --device (cuda when available)."""
    p.add_argument("--model", default="qwen3-30m", help=model_help)
    p.add_argument("--dtype", default="float32", choices=list(dtypes), help="weights and compute dtype")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (cuda when one is available)")


def int_list(text: str, option: str) -> list[int]:
    """'8,16,32' -> [8, 16, 32]; ConfigError naming `option` unless all are integers >= 1."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"{option} must be comma-separated integers >= 1, got {text!r}")
    return values


def dtype_list(text: str, option: str = "--dtypes") -> list[torch.dtype]:
    """"float32,bfloat16" -> [torch.float32, torch.bfloat16]; ConfigError naming the option otherwise."""
    out = []
    for d in text.split(","):
        if d not in ("float32", "bfloat16"):
            raise ConfigError(f"{option}: {d!r} is not float32 or bfloat16")
        out.append(getattr(torch, d))
    return out


def check_args(args, *, positive: tuple[str, ...] = ()) -> torch.device:
    """Check --device, --backend, --profile-window and the integer options in `positive` (attribute
    names, each >= 1) of a parsed benchmark namespace; returns the device."""
    from rlengine.telemetry.profiler import ProfileWindow

    device = check_device(args.device, "--device")
    if getattr(args, "backend", None) is not None:
        check_backend(args.backend, device, "--backend")
    for name in positive + ("threads",):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if getattr(args, "profile_window", None) is not None:
        try:
            ProfileWindow.parse(args.profile_window)
        except ValueError as exc:
            raise ConfigError(f"--profile-window: {exc}") from None
    return device
