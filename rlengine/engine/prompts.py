"""Prompt forms accepted by LLM.generate / add_request / chat -> token ids (+ the text, when there was one).

vLLM's forms: a str (encoded with add_special_tokens=True, vLLM's rule for text prompts), a token-id list
(our trainer's form; lists, tuples, 1-D int tensors, numpy ints), {"prompt_token_ids": [...]} and
{"prompt": "..."}. LLM.chat renders each conversation with the tokenizer's chat template and encodes
the rendering with add_special_tokens=False (the template already wrote the special tokens), which is
what transformers' apply_chat_template(tokenize=True) returns. Text forms need a tokenizer; the error
says so, naming the prompt.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from rlengine.model.tokenizer import Tokenizer


@dataclass(slots=True)
class Prompt:
    """One parsed prompt."""

    token_ids: list[int]        # what the engine prefills
    text: str | None            # the prompt text (RequestOutput.prompt); None for token-id prompts


def token_ids(prompt, where: str) -> list[int]:
    """A prompt as a list of Python ints (lists, tuples, 1-D int tensors, numpy ints accepted)."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        raise TypeError(f"{where}: token ids must be integers (a list[int]), got a str; pass text to "
                        "generate(), or here as {'prompt': text}")
    if isinstance(prompt, bytes) or not hasattr(prompt, "__iter__"):
        raise TypeError(f"{where}: token ids must be integers (a list[int]), got a {type(prompt).__name__}")
    ids = []
    for t in prompt:
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise TypeError(f"{where}: token ids must be integers, got {type(t).__name__} {t!r}") from None
    return ids


def _need_tokenizer(tokenizer: Tokenizer | None, where: str) -> Tokenizer:
    if tokenizer is None:
        raise ValueError(f"{where}: a text prompt needs a tokenizer, and this engine has none (it was built "
                         "from an nn.Module): pass LLM(model, tokenizer=Tokenizer or checkpoint directory), "
                         "or give token ids")
    return tokenizer


def parse_prompt(prompt, tokenizer: Tokenizer | None, where: str, *, allow_str: bool = True) -> Prompt:
    """Any accepted prompt form -> Prompt. allow_str=False: a bare str is refused (add_request keeps
    token ids or dicts, so a str there is not mistaken for a list of characters)."""
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt_token_ids"}:
            return Prompt(token_ids(prompt["prompt_token_ids"], where), None)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            prompt = prompt["prompt"]
        else:
            raise TypeError(f"{where}: a dict prompt is {{'prompt_token_ids': [...]}} or {{'prompt': str}}, "
                            f"got keys {sorted(keys)}")
    elif not allow_str or not isinstance(prompt, str):
        return Prompt(token_ids(prompt, where), None)
    tok = _need_tokenizer(tokenizer, where)
    return Prompt(tok.encode(prompt, add_special_tokens=True), prompt)


def prompt_list(prompts) -> list:
    """generate()'s argument -> a list of prompts: one str / dict is one prompt; a flat list of ints is refused
    (ambiguous: one prompt, or many one-token prompts)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, torch.Tensor) and prompts.dim() == 1:
        raise TypeError("generate() takes a list of prompts (list[list[int]]), got a single 1-D tensor")
    try:
        prompts = list(prompts)
    except TypeError:
        raise TypeError(f"generate() takes a prompt or a list of prompts (str, token ids, or a dict), got "
                        f"{type(prompts).__name__} {prompts!r:.40}") from None
    if prompts and isinstance(prompts[0], int):
        raise TypeError("generate() takes a list of prompts (list[list[int]]), got a single flat list")
    return prompts


def chat_prompts(tokenizer: Tokenizer | None, messages, *, add_generation_prompt: bool,
                 chat_template: str | None, kwargs: dict) -> list[Prompt]:
    """One conversation (list of message dicts) or a list of them -> Prompts (rendered, then encoded)."""
    tok = _need_tokenizer(tokenizer, "chat")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("chat: messages must be a non-empty list of {'role', 'content'} dicts, or a list of them")
    conversations = messages if isinstance(messages[0], (list, tuple)) else [messages]
    out = []
    for conv in conversations:
        text = tok.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt,
                                       chat_template=chat_template, **kwargs)
        out.append(Prompt(tok.encode(text), text))
    return out
