"""Tools: Python functions with a JSON schema, as a tool environment (tool_env.py) calls them.

A tool is a function and its schema in the OpenAI / transformers form that chat templates render
(`apply_chat_template(tools=[...])`):
    {"type": "function", "function": {"name": ..., "description": ..., "parameters":
        {"type": "object", "properties": {arg: {"type": ..., "description": ...}}, "required": [...]}}}
A plugin is "package.module:function" whose function carries its schema as `fn.tool_schema` (a dict,
or a JSON string), or a Tool object; built-in tools are named (BUILTIN_TOOLS). A tool with
`needs_problem` gets the trajectory's prompt row as its first argument: what only the tool may see
(the built-in lookup's table, in Problem.extra), never shown to the model. A tool returns text (other
values are shown as JSON). Every failure to load is a ToolError (a ConfigError: one line, exit 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from rlengine.rl.data.rewards import import_object
from rlengine.rl.env.api import EnvError

JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


class ToolError(EnvError):
    """A tool that cannot load, or whose schema does not parse."""


@dataclass(frozen=True, slots=True)
class Tool:
    """One callable tool: its name, function and JSON schema."""

    name: str
    fn: Callable
    schema: dict                  # {"type": "function", "function": {...}} (check_schema)
    needs_problem: bool = False   # fn(problem, **args): the prompt row's hidden fields reach the tool

    @property
    def params(self) -> list[str]:
        """Argument names in schema order (the compact call format's positional order)."""
        return list(self.schema["function"]["parameters"].get("properties", {}))

    def check_args(self, args: dict) -> str | None:
        """Why `args` do not fit the schema (unknown or missing names, wrong JSON types), or None."""
        p = self.schema["function"]["parameters"]
        props = p.get("properties", {})
        unknown = sorted(set(args) - set(props))
        missing = [k for k in p.get("required", []) if k not in args]
        if unknown or missing:
            return f"{self.name}: unknown arguments {unknown}" if unknown else \
                f"{self.name}: missing arguments {missing}"
        for k, v in args.items():
            want = JSON_TYPES.get(props[k].get("type", ""), object)
            if not isinstance(v, want) or (isinstance(v, bool) and props[k].get("type") in ("integer", "number")):
                return f"{self.name}: argument {k!r} must be {props[k].get('type')}, got {type(v).__name__}"
        return None


def check_schema(schema, where: str) -> dict:
    """A tool schema (dict or JSON text) -> the dict, checked; ToolError naming what is wrong."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ToolError(f"{where}: the tool schema is not JSON ({exc})") from None
    fn = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(fn, dict) or schema.get("type") != "function":
        raise ToolError(f"{where}: a tool schema is {{\"type\": \"function\", \"function\": {{\"name\", "
                        "\"description\", \"parameters\"}}}}")
    name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(name, str) or not name.isidentifier():
        raise ToolError(f"{where}: function.name must be an identifier, got {name!r}")
    props = params.get("properties", {}) if isinstance(params, dict) else None
    if not isinstance(params, dict) or params.get("type") != "object" or not isinstance(props, dict):
        raise ToolError(f"{where}: function.parameters must be {{\"type\": \"object\", \"properties\": {{...}}}}")
    for arg, spec in props.items():
        if not isinstance(spec, dict) or spec.get("type", "string") not in JSON_TYPES:
            raise ToolError(f"{where}: parameter {arg!r} needs a JSON type ({', '.join(JSON_TYPES)})")
    required = params.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        raise ToolError(f"{where}: function.parameters.required must list declared parameters, got {required!r}")
    return {"type": "function", "function": {**fn, "parameters": params}}


def make_tool(fn: Callable, schema, *, needs_problem: bool = False, where: str = "tool") -> Tool:
    schema = check_schema(schema, where)
    return Tool(schema["function"]["name"], fn, schema, needs_problem)


def lookup(problem, key: str) -> str:
    """The built-in key -> value table of a prompt row (Problem.extra["table"]): the model never sees it."""
    table = problem.extra.get("table", {})
    return str(table[key]) if key in table else "none"


BUILTIN_TOOLS: dict[str, Tool] = {
    "lookup": make_tool(lookup, {"type": "function", "function": {
        "name": "lookup", "description": "The value stored under a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "the key"}},
                       "required": ["key"]}}}, needs_problem=True),
}


def load_tool(spec: str) -> Tool:
    """A built-in tool name, or "package.module:function" (fn.tool_schema) / "package.module:TOOL" (a Tool)."""
    where = f"env.tools entry {spec!r}"
    if ":" not in spec:
        if spec not in BUILTIN_TOOLS:
            raise ToolError(f"{where}: unknown tool; built-in: {', '.join(sorted(BUILTIN_TOOLS))}, or a plugin "
                            "'package.module:function'")
        return BUILTIN_TOOLS[spec]
    obj = import_object(spec, where, ToolError)
    if isinstance(obj, Tool):
        return obj
    if not callable(obj) or getattr(obj, "tool_schema", None) is None:
        raise ToolError(f"{where}: a tool plugin is a Tool, or a function with a `tool_schema` attribute")
    return make_tool(obj, obj.tool_schema, needs_problem=bool(getattr(obj, "needs_problem", False)), where=where)


def load_tools(specs) -> list[Tool]:
    tools = [load_tool(s) for s in specs]
    names = [t.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ToolError(f"env.tools: two tools named {dup[0]!r}")
    return tools
