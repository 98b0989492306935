"""generation_config.json of a checkpoint: the ids that end a response.

Chat checkpoints list more than one EOS id there (Qwen3: <|im_end|> and <|endoftext|>), while
config.json names one. The model factory merges both into the model's config, so every engine on the
model stops at all of them; the tokenizer adds its own eos token (Tokenizer.eos_token_ids). Only
eos_token_id is read: sampling defaults (temperature, top_p) there are not applied.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlengine.model.loader import CheckpointError

FILE = "generation_config.json"


def read_json(file: Path) -> dict:
    """A checkpoint's JSON file -> dict; CheckpointError naming the file when it is not a JSON object."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def id_list(value, where: str) -> list[int]:
    """An eos_token_id value (None, an int, or a list of ints) -> list[int]."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(f"{where}: eos_token_id must be an int or a list of ints >= 0, got {value!r}")
    return list(values)


def generation_eos_ids(path: str | Path) -> list[int]:
    """eos_token_id of path/generation_config.json as a list ([] when the file or the field is absent)."""
    file = Path(path) / FILE
    if not file.is_file():
        return []
    return id_list(read_json(file).get("eos_token_id"), str(file))


def merge_ids(*lists: list[int]) -> list[int]:
    """Union in first-seen order."""
    return list(dict.fromkeys(i for ids in lists for i in ids))
