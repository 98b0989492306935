"""Loading a job's config: a TOML file (or a packaged name) plus dotted command-line overrides.

    rlengine train --config grpo.toml --train.b_train 256 --gen.b_gen 512

Overrides are parsed by their field's declared type (values.py) and the result is validated by
the section dataclasses (sections.py); every problem is a ConfigError naming the field.
"""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path

from rlengine.model.config import ConfigError
from rlengine.rl.config.sections import _SECTION_TYPES, _check
from rlengine.rl.config.train_config import TrainConfig
from rlengine.rl.config.values import parse_value


def packaged_config(path: str | Path) -> Path:
    """A --config value as a file: the path itself when it exists, else a bare name (no suffix, no
    directory) of a config shipped in rlengine/configs ("gsm8k" -> rlengine/configs/gsm8k.toml)."""
    path = Path(path)
    if path.is_file() or path.suffix or len(path.parts) != 1:
        return path
    from importlib import resources

    shipped = Path(str(resources.files("rlengine") / "configs" / f"{path}.toml"))
    if not shipped.is_file():
        names = sorted(p.stem for p in shipped.parent.glob("*.toml"))
        raise ConfigError(f"config {str(path)!r}: no such file, and no packaged config of that name "
                          f"(packaged: {', '.join(names)})")
    return shipped


def load_job_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> TrainConfig:
    """TOML file (or a `base` dict, e.g. a run's saved config) + dotted overrides
    ["--train.b_train", "256", "--gen.b_gen=512", ...]."""
    data: dict = {k: dict(v) if isinstance(v, dict) else v for k, v in (base or {}).items()}  # from_dict checks
    if path:
        path = packaged_config(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory; give a TOML file")
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: invalid TOML ({exc})") from None
    for key, value in split_overrides(overrides or []):
        section, name = key.split(".", 1)
        _check(isinstance(data.setdefault(section, {}), dict),
               f"{path or 'the config'}: section [{section}] must be a table of key = value lines, got "
               f"{section} = {data[section]!r} (so --{key} has nowhere to go)")
        declared = typing.get_type_hints(_SECTION_TYPES[section]) if section in _SECTION_TYPES else {}
        data[section][name] = parse_value(value, declared.get(name))
    return TrainConfig.from_dict(data)


def split_overrides(args: list[str]) -> list[tuple[str, str]]:
    """["--a.b", "1", "--c.d=x"] -> [("a.b", "1"), ("c.d", "x")]; malformed ones are ConfigErrors."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg[2:].partition("=")
        _check(arg.startswith("--") and "." in key, f"override {arg!r} must look like --section.key VALUE")
        if not eq:
            _check(i + 1 < len(args), f"override --{key} needs a value")
            i += 1
            value = args[i]
        pairs.append((key, value))
        i += 1
    return pairs


load_config = load_job_config  # the name before load_job_config; kept for old imports
