"""Tool-call parsing: the Qwen / Hermes format as a real chat template renders it, the compact format of the
built-in tokenizer, and malformed calls answered with counted error observations (never an exception).

The template is Qwen2.5-Instruct's tool template, committed beside this test (fixtures/qwen_tools_template.jinja),
on a random tiny checkpoint (tests/support/text_ckpt.py). A conversation with tool calls and tool results is
rendered by transformers' apply_chat_template (the reference) and by rlengine's; the assistant turn must
parse into the calls it was rendered from, and HermesFormat.observation must be exactly the text the
template puts between the assistant's <|im_end|> and the next assistant turn.
"""

from pathlib import Path

import pytest

from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.data.tasks import Problem
from rlengine.rl.env.api import End, ModelTurn
from rlengine.rl.env.pending import Pending
from rlengine.rl.env.tool_calls import BadCall, CompactFormat, HermesFormat, ToolCall
from rlengine.rl.env.tool_env import ToolBox
from rlengine.rl.env.tools import BUILTIN_TOOLS, make_tool
from tests.support.text_ckpt import build_text_checkpoint

TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen_tools_template.jinja").read_text()
ADD = make_tool(lambda a, b: a + b, {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}})
SCHEMAS = [BUILTIN_TOOLS["lookup"].schema, ADD.schema]
CALLS = [ToolCall("lookup", {"key": "qx"}), ToolCall("add", {"a": 2, "b": 40})]


def _resolve(out):
    while isinstance(out, Pending):
        result = out.poll()
        if result is None:
            out.wait(0.05)
            continue
        out = result
    return out


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    return build_text_checkpoint(tmp_path_factory.mktemp("qwen_tools") / "ckpt", chat_template=TEMPLATE)


def test_hermes_calls_and_results_match_a_qwen_chat_template(qwen_ckpt):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(qwen_ckpt.path))
    tok = Tokenizer.from_pretrained(qwen_ckpt.path)
    user = [{"role": "user", "content": "What is under qx, and 2 + 40?"}]
    calls = [{"type": "function", "function": {"name": c.name, "arguments": c.args}} for c in CALLS]
    convo = user + [{"role": "assistant", "content": "", "tool_calls": calls},
                    {"role": "tool", "content": "7"}, {"role": "tool", "content": "42"},
                    {"role": "assistant", "content": "7 and 42"}]
    full = tok.apply_chat_template(convo, tools=SCHEMAS, add_generation_prompt=False)
    assert full == ref.apply_chat_template(convo, tools=SCHEMAS, tokenize=False)  # the reference renders the same
    prompt = tok.apply_chat_template(user, tools=SCHEMAS)
    assert full.startswith(prompt) and '"name": "lookup"' in prompt  # the schemas reach the prompt
    # the model's first turn: its tokens up to and with <|im_end|> (the stop token), decoded as the driver does
    turn_text = full[len(prompt):full.index("<|im_end|>", len(prompt))]
    ids = tok.encode(turn_text) + [qwen_ckpt.eos_token_ids[0]]
    fmt = HermesFormat()
    assert fmt.parse(tok.decode(ids)) == CALLS
    box = ToolBox([BUILTIN_TOOLS["lookup"], ADD], fmt, lambda c, a, *r: float(c == a))
    problem = Problem("q", "7 and 42", extra={"table": {"qx": 7}})
    obs = _resolve(box(problem).step(ModelTurn(0, ids, tok.decode(ids), "stop")))
    assert full == prompt + turn_text + "<|im_end|>" + obs + "7 and 42<|im_end|>\n"
    assert box.counts["tool_calls"] == 2 and box.counts["tool_errors"] == 0


MALFORMED = [
    ('<tool_call>\n{"name": "lookup", "arguments": {"key": "qx"}\n</tool_call>', "not JSON"),  # a brace short
    ('<tool_call>\n["lookup"]\n</tool_call>', '{"name"'),
    ('<tool_call>\n{"name": "lookup", "arguments": [1]}\n</tool_call>', "not a JSON object"),
    ('<tool_call>\n{"name": "lookup", "arguments": {"key": "qx"}}', "without its </tool_call>"),
    ('<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>', "unknown tool 'search'"),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', "missing arguments ['b']"),
    ('<tool_call>\n{"name": "add", "arguments": {"a": "1", "b": 2}}\n</tool_call>', "'a' must be integer"),
]


@pytest.mark.parametrize("text,named", MALFORMED, ids=["bad-json", "not-an-object", "args-not-object", "unclosed",
                                                       "unknown-tool", "missing-arg", "wrong-type"])
def test_malformed_hermes_call_gets_an_error_observation_and_is_counted(text, named):
    box = ToolBox([BUILTIN_TOOLS["lookup"], ADD], HermesFormat(), lambda *a: 0.0)
    obs = _resolve(box(Problem("q", "1")).step(ModelTurn(0, [], text, "stop")))
    assert isinstance(obs, str) and obs.startswith("\n<|im_start|>user\n<tool_response>\nerror: ") and named in obs
    assert box.counts["tool_calls"] == 1 and box.counts["tool_errors"] == 1


def test_compact_format_calls_answers_and_malformed():
    fmt = CompactFormat()
    assert fmt.parse("lookup(qx)") == [ToolCall("lookup", ["qx"])]
    assert fmt.parse("add(a=2, b=40)") == [ToolCall("add", {"a": "2", "b": "40"})]
    assert fmt.parse("7") == []  # a final answer
    assert all(isinstance(c, BadCall) for c in fmt.parse("lookup(qx") + fmt.parse("add(a=1, 2)") + fmt.parse("f(,)"))
    box = ToolBox([BUILTIN_TOOLS["lookup"], ADD], fmt, lambda c, a, *r: float(c.strip() == a))
    problem = Problem("qx?", "7", extra={"table": {"qx": 7}})
    assert _resolve(box(problem).step(ModelTurn(0, [], "lookup(qx)", "stop"))) == "=7"
    assert _resolve(box(problem).step(ModelTurn(0, [], "add(2, 40)", "stop"))) == "=42"  # typed from the schema
    assert _resolve(box(problem).step(ModelTurn(0, [], "lookup(qx", "stop"))) == "=error"
    assert _resolve(box(problem).step(ModelTurn(0, [], "add(x, 1)", "stop"))) == "=error"  # x is no integer
    end = box(problem).step(ModelTurn(1, [], "7", "stop"))
    assert isinstance(end, End) and end.reward == 1.0
    assert box.counts["tool_calls"] == 4 and box.counts["tool_errors"] == 2
