"""Writes a tokenizer with a real vocabulary's size (Qwen3's 151,936 ids) for the realvocab job.

    python tools/make_realvocab_tokenizer.py DIR [--vocab-size 151936]

No model hub is reachable from every machine rlengine runs on, so the job's tokenizer is made here: a
`tokenizers` WordLevel model over whitespace- and punctuation-split words. Its first ids are the words of
the packaged prompts and the chat template's roles, the rest synthetic words over letters, digits and
punctuation (so decoded random responses differ in their share of letters), and Qwen's special tokens sit at
Qwen's ids (<|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645). tokenizer_config.json names
<|im_end|> as EOS and carries the job's chat template (rlengine/configs/data/realvocab_chat_template.jinja).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "rlengine" / "configs" / "data"
SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789.,;:!?-"


def _synthetic(i: int) -> str:
    """The i-th synthetic word: i written in base len(ALPHABET), 2+ characters."""
    out = ""
    i += len(ALPHABET)  # at least two characters: never a one-letter word of the prompts
    while i:
        i, r = divmod(i, len(ALPHABET))
        out += ALPHABET[r]
    return "w" + out


def build_tokenizer(out_dir: str | Path, vocab_size: int = 151936) -> Path:
    """Write tokenizer.json and tokenizer_config.json for `vocab_size` ids into out_dir; returns it."""
    if vocab_size <= max(SPECIALS.values()):
        raise ValueError(f"vocab_size must exceed {max(SPECIALS.values())} (Qwen's special ids), got {vocab_size}")
    words = ["[UNK]", "user", "assistant", "system"]
    for line in (DATA / "realvocab_prompts.jsonl").read_text().splitlines():
        for w in re.findall(r"\w+|[^\w\s]+", json.loads(line)["prompt"]):
            if w not in words:
                words.append(w)
    vocab = {w: i for i, w in enumerate(words)}
    by_id = {i: s for s, i in SPECIALS.items()}
    n = 0
    for i in range(len(words), vocab_size):
        if i in by_id:
            vocab[by_id[i]] = i
            continue
        while (w := _synthetic(n)) in vocab:
            n += 1
        vocab[w] = i
        n += 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIALS))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    template = (DATA / "realvocab_chat_template.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template}, indent=1))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--vocab-size", type=int, default=151936)
    args = p.parse_args()
    path = build_tokenizer(args.out_dir, args.vocab_size)
    print(f"wrote a {args.vocab_size}-id tokenizer to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
