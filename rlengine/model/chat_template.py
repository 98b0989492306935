"""Chat templates: render a checkpoint's Jinja chat template the way transformers does, with jinja2 alone.

Tokenizer.apply_chat_template (tokenizer.py) calls `render`; transformers is not a runtime dependency.
Same environment as transformers' apply_chat_template (utils/chat_template_utils.py), so a checkpoint's
template renders the same string: an immutable sandbox (templates from the Hub are untrusted code),
trim_blocks + lstrip_blocks, the loopcontrols extension, `raise_exception(msg)`, `strftime_now(fmt)`, a
`tojson` filter that keeps non-ASCII text, and the special tokens (bos_token, eos_token, ...) plus
add_generation_prompt, tools and documents as variables. Simplification: the `{% generation %}` tag is
accepted and renders its body (no assistant-token mask); no continue_final_message.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rlengine.model.config import ConfigError


class ChatTemplateError(ConfigError):
    """A chat template is missing, does not compile, or raised while rendering (a user error, like ConfigError)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers in some templates): renders the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters (<, >, &, '), which would change the prompt text
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """A template string -> compiled template (cached: checkpoints keep one template for their lifetime)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc} (line {exc.lineno})") from None


def _plain(value):
    """A JSON-like copy of the caller's data (what the sandbox sees): dicts, lists, scalars; None kept (render
    drops the None keys of each message only, as transformers does: nested nulls such as a tool call's
    argument or a tool schema's "default" are data)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise ChatTemplateError(f"chat messages may hold only dicts, lists, strings and numbers, got "
                            f"{type(value).__name__}")


def render(source: str, messages: list[dict], *, add_generation_prompt: bool, special_tokens: dict[str, str],
           tools: list[dict] | None = None, documents: list[dict] | None = None, **kwargs) -> str:
    """Render one conversation. special_tokens: {"bos_token": ..., "eos_token": ...} (those set); kwargs are
    extra template variables (chat_template_kwargs, e.g. enable_thinking) and override special_tokens."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("a conversation must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
    template = compile_template(source)
    variables = {**special_tokens, **kwargs}
    try:
        # a message's None keys are dropped (templates handle a missing key, not `content=None`), as transformers does
        messages = [{k: v for k, v in m.items() if v is not None} for m in _plain(messages)]
        return template.render(messages=messages, tools=_plain(tools), documents=_plain(documents),
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template: {exc}") from None
