"""Tokenizers: Hugging Face tokenizer.json through the `tokenizers` library, plus a tiny built-in one.

The built-in tokenizer is character-level over digits, arithmetic symbols, lowercase letters
and a few punctuation marks, with <pad>, <bos>, <eos> specials; it is what the built-in
tasks and the embedded default job use with the tiny presets (ids < 128, well inside their
vocabularies). It is a real `tokenizers.Tokenizer` (WordLevel model, per-character split),
so it saves to and loads from tokenizer.json like any other.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

SPECIALS = ("<pad>", "<bos>", "<eos>")
BUILTIN_CHARS = "0123456789+-*/=()?:., " + "abcdefghijklmnopqrstuvwxyz"


class Tokenizer:
    """encode(str) -> list[int], decode(list[int]) -> str, with pad/bos/eos ids."""

    def __init__(self, hf: HFTokenizer, *, eos_token: str | None = None, bos_token: str | None = None,
                 pad_token: str | None = None):
        self.hf = hf
        self.eos_token_id = hf.token_to_id(eos_token) if eos_token else None
        self.bos_token_id = hf.token_to_id(bos_token) if bos_token else None
        self.pad_token_id = hf.token_to_id(pad_token) if pad_token else None

    @classmethod
    def from_file(cls, path: str | Path, *, eos_token: str | None = None) -> "Tokenizer":
        """Load tokenizer.json (a file, or a checkpoint directory containing one)."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{file}: tokenizer.json not found")
        hf = HFTokenizer.from_file(str(file))
        if eos_token is None:
            vocab = hf.get_vocab()
            eos_token = next((t for t in ("<|im_end|>", "<|endoftext|>", "</s>", "<eos>") if t in vocab), None)
        return cls(hf, eos_token=eos_token)

    @classmethod
    def builtin(cls) -> "Tokenizer":
        """The tiny character-level tokenizer of the built-in tasks."""
        vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(BUILTIN_CHARS))}
        hf = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        hf.decoder = decoders.Fuse()
        hf.add_special_tokens(list(SPECIALS))
        return cls(hf, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>")

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))
