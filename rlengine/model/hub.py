"""Model names resolved to files: a preset, a local checkpoint directory, or a Hugging Face hub id.

Every place that turns a model name into files calls resolve_model first (model/factory.py for
LLM, the trainer and the demo; the loader's load_pretrained / load_model_config; plan/preflight.py;
the job's memory plan through factory.model_config). The order is fixed: a preset name, then a local
directory, then a hub id, so a preset wins over a hub id of the same spelling and a directory over
an id that looks like it. A hub id comes back as its snapshot directory in the Hugging Face cache:
huggingface_hub.snapshot_download with local_files_only when the hub is offline (HF_HUB_OFFLINE) or
the files are cached, else a download of only the files rlengine reads (MODEL_FILES). The hub's own
errors (offline and not cached, unknown repo or revision, gated repo) become one ConfigError naming
the id and the fix, which the CLI prints as one line.

Simplifications: a hub id is `org/name` (legacy ids without an org predate every model family rlengine
runs, and a mistyped preset should not become a hub request); a cached revision is used as it is,
without asking the hub whether a branch moved since (pin a commit sha, or download again to move on).
"""

from __future__ import annotations

import os
from pathlib import Path

from rlengine.model.config import PRESETS, ConfigError

# What rlengine reads from a checkpoint: safetensors weights (and their shard index), the model and
# generation configs, the tokenizer, and chat templates. Never pickled weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
                   "additional_chat_templates/*.jinja")
MODEL_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json") + TOKENIZER_FILES
FILES = {"model": MODEL_FILES, "tokenizer": TOKENIZER_FILES}


def is_hub_id(name: str) -> bool:
    """True for a well-formed `org/name` repo id (huggingface_hub's own validation)."""
    if name.count("/") != 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model(name: str, *, revision: str | None = None, what: str = "model", files: str = "model") -> str:
    """A model name -> what rlengine loads: a preset name or a local directory unchanged, a hub id -> its
    snapshot directory (cached, or downloaded: the files of FILES[files], "model" or "tokenizer").

    revision (a branch, tag or commit sha) applies to hub ids only. `what` names the option in messages
    (model.name, --model, tokenizer). ConfigError for a name that is none of the three, and for every
    hub failure (naming the id); with files="model", a repo without safetensors weights is refused."""
    name, revision = str(name), revision or None
    local = "a preset" if name in PRESETS else "a local directory" if Path(name).is_dir() else None
    if local is not None:
        if revision is not None:
            raise ConfigError(f"{what} {name!r} is {local}; a revision ({revision!r}) applies only to a "
                              "Hugging Face hub id (org/name)")
        return name
    if not is_hub_id(name):
        if os.sep in name or name.startswith(".") or (os.altsep and os.altsep in name):
            raise ConfigError(f"{what} {name!r}: checkpoint directory not found")
        raise ConfigError(f"{what} {name!r} is neither a preset ({', '.join(sorted(PRESETS))}), a checkpoint "
                          "directory nor a Hugging Face hub id (org/name)")
    path = Path(_snapshot(name, revision, what, files))
    if files == "model" and not any(path.glob("*.safetensors")):
        bins = sorted(p.name for p in path.glob("*.bin"))
        held = f"only pickled weights ({', '.join(bins[:3])})" if bins else "no *.safetensors weights"
        raise ConfigError(f"{what} {_at(name, revision)}: the hub repo has {held}; rlengine loads safetensors "
                          "only (it never unpickles .bin weights): use a repo or revision that ships *.safetensors")
    return str(path)


def _at(name: str, revision: str | None) -> str:
    return f"{name!r}" + (f" (revision {revision!r})" if revision else "")


def _complete(path: str, files: str) -> bool:
    """Whether a cached snapshot holds what `files` needs (a tokenizer-only download lacks the weights)."""
    p = Path(path)
    if files == "model":
        return (p / "config.json").is_file() and any(p.glob("*.safetensors"))
    return any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def _snapshot(repo_id: str, revision: str | None, what: str, files: str) -> str:
    """The snapshot directory of repo_id at revision: from the cache when it is there (or the hub is
    offline), else downloaded (FILES[files] only). Maps huggingface_hub's errors to ConfigError."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                       RepositoryNotFoundError, RevisionNotFoundError)

    at = _at(repo_id, revision)
    # constants read at call time: the cache and offline switch huggingface_hub settled on at import
    args = dict(revision=revision, cache_dir=constants.HF_HUB_CACHE, allow_patterns=list(FILES[files]))
    try:
        path = snapshot_download(repo_id, local_files_only=True, **args)
        if constants.HF_HUB_OFFLINE or _complete(path, files):
            return path
    except LocalEntryNotFoundError:  # not cached (or cached incompletely)
        if constants.HF_HUB_OFFLINE:
            raise ConfigError(f"{what} {at}: no local directory of that name, and the Hugging Face hub id is not "
                              f"in the cache ({constants.HF_HUB_CACHE}) while the hub is offline (HF_HUB_OFFLINE); "
                              "download it once online, or unset HF_HUB_OFFLINE") from None
    try:
        return snapshot_download(repo_id, **args)
    except GatedRepoError:  # before RepositoryNotFoundError: a gated repo is one of those
        raise ConfigError(f"{what} {at}: the hub repo is gated; accept its terms on huggingface.co and log in "
                          "(`hf auth login`) or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{what} {at}: no local directory of that name, and no Hugging Face hub repo either "
                          "(or a private one this token cannot see)") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{what} {at}: the hub repo has no revision {revision!r} (a branch, tag or commit "
                          "sha)") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        raise ConfigError(f"{what} {at}: not in the Hugging Face cache and the hub cannot be reached "
                          f"({type(exc).__name__}); connect once to download it") from None
