"""Tool-call formats: a model turn's text -> tool calls (or a final answer), and results -> observation text.

Two formats, one interface (parse, answer, observation):
- hermes: what Qwen2.5 / Qwen3 / Hermes checkpoints are trained on. Calls are
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks in the assistant turn, which ends
  with <|im_end|>; results come back as the chat template renders `tool` messages: a user turn of
  `<tool_response>\n...\n</tool_response>` blocks, then the assistant header the next turn continues from.
  observation() writes exactly the text the template renders between the assistant's <|im_end|> and the
  next turn (tests/rl/test_tools_parser.py checks it against a Qwen-style template).
- compact: for the built-in character tokenizer (no braces, no special tags): the whole turn is
  `name(arg, ...)` or `name(key=value, ...)`, and a result comes back as `=result` (`=error` for any error).
A turn without any call is the final answer. A call that does not parse is a BadCall: the tool
environment answers it with an error observation and counts it; nothing here raises on model output.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments (a dict; compact positional ones as a list)."""

    name: str
    args: dict | list


@dataclass(frozen=True, slots=True)
class BadCall:
    """A call that does not parse, and why."""

    error: str


class HermesFormat:
    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall | BadCall]:
        """The turn's calls in order ([] = no call: a final answer)."""
        calls: list[ToolCall | BadCall] = [self._one(body) for body in self._BLOCK.findall(text)]
        if text.count("<tool_call>") > len(calls):
            calls.append(BadCall("a <tool_call> without its </tool_call>"))
        return calls

    @staticmethod
    def _one(body: str) -> ToolCall | BadCall:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            return BadCall(f"the tool call is not JSON ({exc.msg} at character {exc.pos})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return BadCall('a tool call is {"name": ..., "arguments": {...}}')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return BadCall("the tool call's arguments are not a JSON object")
        if not isinstance(args, dict):
            return BadCall("the tool call's arguments are not a JSON object")
        return ToolCall(obj["name"], args)

    def answer(self, text: str) -> str:
        return text.strip()

    def observation(self, results: list[str]) -> str:
        body = "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
        return f"\n<|im_start|>user{body}<|im_end|>\n<|im_start|>assistant\n"


class CompactFormat:
    name = "compact"
    _CALL = re.compile(r"^\s*([a-z_][a-z0-9_]*)\((.*)\)\s*$", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall | BadCall]:
        m = self._CALL.match(text)
        if m is None:
            return [BadCall("a call is name(arg, ...)")] if "(" in text or ")" in text else []
        name, inner = m.group(1), m.group(2).strip()
        parts = [p.strip() for p in inner.split(",")] if inner else []
        if any(not p for p in parts):
            return [BadCall("an empty argument")]
        named = [p.partition("=") for p in parts if "=" in p]
        if named and len(named) != len(parts):
            return [BadCall("arguments are all positional or all key=value")]
        return [ToolCall(name, {k.strip(): v.strip() for k, _, v in named} if named else parts)]

    def answer(self, text: str) -> str:
        return text.strip()

    def observation(self, results: list[str]) -> str:
        # errors come back as the bare word: a character vocabulary has no room for the message (counted anyway)
        return "=" + ",".join("error" if r.startswith("error:") else r for r in results)


FORMATS = {"hermes": HermesFormat, "compact": CompactFormat}
