"""The checkpoint's tokenizer files: chat templates rendered with jinja2 alone against transformers' own
rendering and tokenisation (the reference nobody here wrote), EOS / pad ids, and the errors of broken files.

Each template variant is written into a copy of the fixture's tokenizer files (no weights needed), then
loaded by rlengine.model.tokenizer.Tokenizer and by transformers' AutoTokenizer.
"""

import json
import shutil

import pytest
import transformers  # the reference implementation (test extra)

from rlengine.model.config import ConfigError
from rlengine.model.chat_template import ChatTemplateError
from rlengine.model.loader import CheckpointError
from rlengine.model.tokenizer import Tokenizer

from tests.support.text_ckpt import CHAT_TEMPLATE


CONVERSATIONS = {
    "user-only": [{"role": "user", "content": "Hello, my name is"}],
    "system+user": [{"role": "system", "content": "You answer in French."},
                    {"role": "user", "content": "The capital of France is"}],
    "multi-turn": [{"role": "user", "content": "What is two plus three?"},
                   {"role": "assistant", "content": "  Five.  "},
                   {"role": "user", "content": "And 日本 café?"}],
    "none-content-dropped": [{"role": "user", "content": "hi", "name": None}],
    # only a message's own None keys go; a null nested inside (a tool call's argument) is data and stays
    "nested-none-kept": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "ok", "tool_calls": [
                             {"type": "function", "function": {"name": "f", "arguments": {"unit": None}}}]}],
}
# Templates that lean on what the environment provides: trim_blocks / lstrip_blocks (no whitespace control),
# loopcontrols, tojson keeping non-ASCII, special-token variables, a kwarg, namespace().
PLAIN = """{% for message in messages %}
    {% if loop.index0 == 0 and message['role'] != 'system' %}
<|im_start|>system
default<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
FEATURES = """{%- set ns = namespace(n=0) %}
{%- for message in messages %}
    {%- if ns.n >= 2 %}{% break %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
    {{- message | tojson }}{{ eos_token }}
{%- endfor %}
{{- '[' ~ (greeting | default('none')) ~ ']' }}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""
TEMPLATES = {"fixture": CHAT_TEMPLATE, "plain": PLAIN, "features": FEATURES}


def _tokenizer_dir(src, dst, **config_changes):
    """A copy of src's tokenizer files with tokenizer_config.json entries changed (None removes one)."""
    dst.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, dst / f)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    for k, v in config_changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
def test_rendering_and_ids_match_transformers(text_checkpoint, tmp_path, template, conversation,
                                             add_generation_prompt):
    path = _tokenizer_dir(text_checkpoint.path, tmp_path / "tok", chat_template=TEMPLATES[template])
    ours, ref = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    msgs = CONVERSATIONS[conversation]
    kw = dict(greeting="héllo 日本") if template == "features" else {}
    want = ref.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False, **kw)
    got = ours.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kw)
    assert got == want
    want_ids = ref.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=True,
                                       return_dict=False, **kw)
    assert ours.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=True, **kw) == want_ids


def test_tool_schemas_keep_their_nulls(text_checkpoint, tmp_path):
    """`tools | tojson` renders a schema's "default": null as transformers does (nothing is dropped from tools)."""
    path = _tokenizer_dir(text_checkpoint.path, tmp_path / "tools",
                          chat_template="{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}")
    ours, ref = Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"unit": {"type": "string", "default": None}}}}}]
    msgs = CONVERSATIONS["user-only"]
    want = ref.apply_chat_template(msgs, tools=tools, tokenize=False)
    assert '"default": null' in want and ours.apply_chat_template(msgs, tools=tools) == want


def test_template_sources_follow_transformers_priority(text_checkpoint, tmp_path):
    """A list of {name, template} in the config; chat_template.jinja over the config's; named templates."""
    msgs = CONVERSATIONS["system+user"]
    listed = _tokenizer_dir(text_checkpoint.path, tmp_path / "listed",
                            chat_template=[{"name": "default", "template": PLAIN},
                                           {"name": "tool_use", "template": FEATURES}])
    ours, ref = Tokenizer.from_pretrained(listed), transformers.AutoTokenizer.from_pretrained(listed)
    assert ours.chat_template == PLAIN
    for name in (None, "tool_use"):
        assert (ours.apply_chat_template(msgs, chat_template=name)
                == ref.apply_chat_template(msgs, chat_template=name, tokenize=False, add_generation_prompt=True))
    jinja = _tokenizer_dir(text_checkpoint.path, tmp_path / "jinja")  # config keeps the fixture's template
    (jinja / "chat_template.jinja").write_text(PLAIN)
    ours, ref = Tokenizer.from_pretrained(jinja), transformers.AutoTokenizer.from_pretrained(jinja)
    assert ours.chat_template == PLAIN == ref.chat_template


def test_special_tokens_and_eos_ids(text_checkpoint):
    tok = Tokenizer.from_pretrained(text_checkpoint.path)
    ref = transformers.AutoTokenizer.from_pretrained(text_checkpoint.path)
    assert tok.eos_token_id == ref.eos_token_id == tok.hf.token_to_id("<|im_end|>")  # from an AddedToken dict
    assert tok.eos_token_ids == text_checkpoint.eos_token_ids == [2, 0]  # generation_config.json's list
    assert tok.pad_token_id == ref.pad_token_id == 0 and tok.bos_token_id is None
    text = "日本 café, naïve"
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text)) == text


def test_pad_falls_back_to_eos_and_a_bare_tokenizer_json_loads(text_checkpoint, tmp_path):
    path = _tokenizer_dir(text_checkpoint.path, tmp_path / "nopad", pad_token=None)
    tok = Tokenizer.from_pretrained(path)
    assert tok.pad_token_id == tok.eos_token_id == 2
    bare = Tokenizer.from_file(text_checkpoint.path / "tokenizer.json")  # no config: eos guessed from the vocab
    assert bare.eos_token_id == 2 and bare.chat_template is None


def test_no_template_is_a_clear_error(text_checkpoint, tmp_path):
    path = _tokenizer_dir(text_checkpoint.path, tmp_path / "base", chat_template=None)
    tok = Tokenizer.from_pretrained(path)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template") as err:
        tok.apply_chat_template(CONVERSATIONS["user-only"])
    assert str(path) in str(err.value) and isinstance(err.value, ConfigError)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.builtin().apply_chat_template(CONVERSATIONS["user-only"])


def test_template_errors(text_checkpoint, tmp_path):
    tok = Tokenizer.from_pretrained(text_checkpoint.path)
    with pytest.raises(ChatTemplateError, match="roles must be user or assistant"):  # raise_exception()
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template(CONVERSATIONS["user-only"], chat_template="{% for x in %}")
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(Exception, match="unsafe|not safely|access"):  # the sandbox
        tok.apply_chat_template(CONVERSATIONS["user-only"], chat_template="{{ messages.__class__.__mro__ }}")


@pytest.mark.parametrize("case", ["no-tokenizer-json", "sentencepiece-only", "bad-json", "bad-template-type",
                                  "eos-not-in-vocab", "bad-token-type", "bad-generation-config"])
def test_broken_tokenizer_files_name_the_file(text_checkpoint, tmp_path, case):
    path = _tokenizer_dir(text_checkpoint.path, tmp_path / case)
    culprit = {"no-tokenizer-json": "tokenizer.json", "sentencepiece-only": "tokenizer.json",
               "bad-json": "tokenizer.json", "bad-generation-config": "generation_config.json"}.get(
        case, "tokenizer_config.json")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    if case in ("no-tokenizer-json", "sentencepiece-only"):
        (path / "tokenizer.json").unlink()
        if case == "sentencepiece-only":
            (path / "tokenizer.model").write_bytes(b"\x00")
    elif case == "bad-json":
        (path / "tokenizer.json").write_text("{not json")
    elif case == "bad-generation-config":
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["<|im_end|>"]}))
    else:
        cfg.update({"bad-template-type": {"chat_template": 7}, "eos-not-in-vocab": {"eos_token": "<|nope|>"},
                    "bad-token-type": {"eos_token": 3}}[case])
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        Tokenizer.from_pretrained(path)
    assert str(path / culprit) in str(err.value)
    if case == "sentencepiece-only":
        assert "tokenizer.model" in str(err.value)
