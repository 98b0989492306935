"""Tokenizers: a checkpoint's tokenizer (tokenizer.json through the `tokenizers` library), plus a tiny built-in one.

Tokenizer.from_pretrained(dir) reads what a Hugging Face checkpoint ships: tokenizer.json (required),
tokenizer_config.json (bos / eos / pad tokens, as strings or AddedToken dicts; chat_template as a string
or a list of {name, template}), chat_template.jinja and additional_chat_templates/*.jinja (transformers
4.43+ / 5.x; they take priority over the config's template, as there) and generation_config.json (its
eos_token_id, an int or a list, joins the tokenizer's eos in `eos_token_ids`). Chat templates render
with chat_template.py (jinja2, transformers' environment); encoding a rendered chat uses
add_special_tokens=False, as transformers' apply_chat_template(tokenize=True) does. add_bos_token is read
but, as in transformers 5 with a tokenizer.json, tokenizer.json's post-processor decides what
add_special_tokens=True adds.
The built-in tokenizer is character-level over digits, arithmetic symbols, lowercase letters
and a few punctuation marks, with <pad>, <bos>, <eos> specials; it is what the built-in
tasks and the embedded default job use with the tiny presets (ids < 128, well inside their
vocabularies). It is a real `tokenizers.Tokenizer` (WordLevel model, per-character split),
so it saves to and loads from tokenizer.json like any other. It has no chat template.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from rlengine.model.chat_template import ChatTemplateError, render
from rlengine.model.generation_config import generation_eos_ids, merge_ids, read_json
from rlengine.model.loader import CheckpointError

SPECIALS = ("<pad>", "<bos>", "<eos>")
BUILTIN_CHARS = "0123456789+-*/=()?:., " + "abcdefghijklmnopqrstuvwxyz"
# transformers' named special tokens: the chat template sees each one that is set, as a variable
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
EOS_GUESSES = ("<|im_end|>", "<|endoftext|>", "</s>", "<eos>")  # a bare tokenizer.json names no eos token
TEMPLATE_FILE, TEMPLATE_DIR = "chat_template.jinja", "additional_chat_templates"


class Tokenizer:
    """encode(str) -> list[int], decode(list[int]) -> str, pad/bos/eos ids, the chat template."""

    def __init__(self, hf: HFTokenizer, *, eos_token: str | None = None, bos_token: str | None = None,
                 pad_token: str | None = None, special_tokens: dict[str, str] | None = None,
                 chat_templates: dict[str, str] | None = None, generation_eos_ids: list[int] = (),
                 add_bos_token: bool | None = None, source: str = "tokenizer"):
        self.hf = hf
        self.source = source                     # the checkpoint directory (or file) in error messages
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        for name, tok in (("eos_token", eos_token), ("bos_token", bos_token), ("pad_token", pad_token)):
            if tok is not None:
                self.special_tokens[name] = tok
        self.eos_token_id = self._id(self.special_tokens.get("eos_token"))
        self.bos_token_id = self._id(self.special_tokens.get("bos_token"))
        self._pad_token_id = self._id(self.special_tokens.get("pad_token"))
        self.chat_templates = dict(chat_templates or {})  # name -> Jinja source; "default" is the one used
        self.generation_eos_ids = list(generation_eos_ids)
        self.add_bos_token = add_bos_token
        if self.eos_token_id is None and self.generation_eos_ids:
            self.eos_token_id = self.generation_eos_ids[0]

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.hf.token_to_id(token)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a response: the tokenizer's eos, then generation_config.json's eos_token_id list."""
        return merge_ids([] if self.eos_token_id is None else [self.eos_token_id], self.generation_eos_ids)

    @property
    def pad_token_id(self) -> int | None:
        """The pad token's id, or the eos id when the tokenizer has no pad token."""
        return self._pad_token_id if self._pad_token_id is not None else self.eos_token_id

    @property
    def chat_template(self) -> str | None:
        """The default chat template (Jinja source), None when the checkpoint has none."""
        return self.chat_templates.get("default")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        """Load a checkpoint directory's tokenizer files; CheckpointError naming the file at fault."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"{path}: checkpoint directory not found")
        file = path / "tokenizer.json"
        if not file.is_file():
            extra = " (only a sentencepiece tokenizer.model: save the tokenizer with transformers to get " \
                    "tokenizer.json)" if (path / "tokenizer.model").is_file() else ""
            raise CheckpointError(f"{file}: missing{extra}")
        hf = _load_tokenizer_json(file)
        cfg_file = path / "tokenizer_config.json"
        cfg = read_json(cfg_file) if cfg_file.is_file() else {}
        special = {name: _token_text(cfg.get(name), cfg_file, name) for name in SPECIAL_NAMES}
        if special["eos_token"] is None:
            vocab = hf.get_vocab()
            special["eos_token"] = next((t for t in EOS_GUESSES if t in vocab), None)
        for name in ("eos_token", "bos_token", "pad_token"):
            if special[name] is not None and hf.token_to_id(special[name]) is None:
                raise CheckpointError(f"{cfg_file}: {name} {special[name]!r} is not in {file.name}'s vocabulary")
        add_bos = cfg.get("add_bos_token")
        return cls(hf, special_tokens=special, chat_templates=_chat_templates(path, cfg, cfg_file),
                   generation_eos_ids=generation_eos_ids(path),
                   add_bos_token=add_bos if isinstance(add_bos, bool) else None, source=str(path))

    @classmethod
    def from_file(cls, path: str | Path, *, eos_token: str | None = None) -> "Tokenizer":
        """A checkpoint directory (from_pretrained), or a bare tokenizer.json file."""
        path = Path(path)
        if path.is_dir():
            return cls.from_pretrained(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: tokenizer.json not found")
        hf = _load_tokenizer_json(path)
        if eos_token is None:
            vocab = hf.get_vocab()
            eos_token = next((t for t in EOS_GUESSES if t in vocab), None)
        return cls(hf, eos_token=eos_token, source=str(path))

    @classmethod
    def builtin(cls) -> "Tokenizer":
        """The tiny character-level tokenizer of the built-in tasks."""
        vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(BUILTIN_CHARS))}
        hf = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        hf.decoder = decoders.Fuse()
        hf.add_special_tokens(list(SPECIALS))
        return cls(hf, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>", source="the built-in tokenizer")

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. add_special_tokens=True applies tokenizer.json's post-processor (what vLLM
        does for a text prompt, e.g. a BOS); the default leaves the text as is (tasks, rendered chats)."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, tokenize: bool = False,
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, **kwargs) -> str | list[int]:
        """Render one conversation ([{"role": ..., "content": ...}, ...]) with the checkpoint's chat template.

        add_generation_prompt: end with the assistant header (what generation continues from).
        tokenize: return token ids (encoded with add_special_tokens=False, as transformers does) instead
        of the string. chat_template: the name of one of the checkpoint's templates, or a Jinja source.
        kwargs: extra template variables (e.g. enable_thinking=False for Qwen3). ChatTemplateError (a
        ConfigError) when there is no template or it fails.
        """
        source = self._template(chat_template, tools)
        text = render(source, messages, add_generation_prompt=add_generation_prompt,
                      special_tokens=self.special_tokens, tools=tools, documents=documents, **kwargs)
        return self.encode(text) if tokenize else text

    def _template(self, chat_template: str | None, tools) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise ChatTemplateError(f"{self.source}: several chat templates and no default; pass chat_template= "
                                    f"one of {sorted(self.chat_templates)}")
        raise ChatTemplateError(f"{self.source}: no chat template (no 'chat_template' in tokenizer_config.json, "
                                f"no {TEMPLATE_FILE}); this looks like a base model: prompt it with plain text")


def _load_tokenizer_json(file: Path) -> HFTokenizer:
    try:
        return HFTokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a bad file
        raise CheckpointError(f"{file}: not a tokenizer.json the tokenizers library can read ({exc})") from None


def _token_text(value, cfg_file: Path, name: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise CheckpointError(f"{cfg_file}: {name} must be a string or an AddedToken dict with 'content', got {value!r}")


def _chat_templates(path: Path, cfg: dict, cfg_file: Path) -> dict[str, str]:
    """name -> template: chat_template.jinja / additional_chat_templates/*.jinja if present, else the config's."""
    files = {"default": path / TEMPLATE_FILE} if (path / TEMPLATE_FILE).is_file() else {}
    if (path / TEMPLATE_DIR).is_dir():
        files.update({f.stem: f for f in sorted((path / TEMPLATE_DIR).glob("*.jinja"))})
    if files:
        try:
            return {name: f.read_text(encoding="utf-8") for name, f in files.items()}
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: unreadable chat template file ({exc})") from None
    value = cfg.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise CheckpointError(f"{cfg_file}: chat_template must be a string or a list of {{name, template}}, "
                          f"got {type(value).__name__}")
