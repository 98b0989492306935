"""The job's environment, from its [env] section: drivers for the rollout and eval engines, tool schemas.

JobEnv is built once per job (rl/trainer/parts.py) when env.name is set: a user environment class
("pkg.module:Name") or the tool environment over env.tools. driver() makes one TrajectoryDriver per
engine, each with its own counts (eval episodes never show in the training metrics) and, for tools,
its own ToolBox. tool_schemas go to the chat template (apply_chat_template(tools=...)) when prompts are
chats; the compact format of the built-in tokenizer needs none (the task's prompt says how to call).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rlengine.rl.env.api import load_environment
from rlengine.rl.env.driver import TrajectoryDriver, TrajectoryLimits
from rlengine.rl.env.tool_calls import FORMATS
from rlengine.rl.env.tool_env import ToolBox
from rlengine.rl.env.tools import load_tools


@dataclass(slots=True)
class JobEnv:
    """The resolved environment of a job."""

    section: object                # the [env] section (rl/config/env_section.py)
    reward_fn: object              # the task's reward: a tool trajectory's final answer is scored with it
    tok: object                    # the run's tokenizer (observations given as text are encoded with it)
    limits: TrajectoryLimits
    call_format: str               # "hermes" | "compact" (tools), "" (a user environment)

    @classmethod
    def from_config(cls, section, reward_fn, tok, *, max_tokens: int, chat: bool) -> "JobEnv | None":
        if not section.name:
            return None
        limits = TrajectoryLimits(max_turns=section.max_turns, max_turn_tokens=section.max_turn_tokens or max_tokens,
                                  max_obs_tokens=section.max_obs_tokens, max_total_tokens=max_tokens)
        fmt = "" if section.name != "tools" else (section.call_format if section.call_format != "auto"
                                                  else "hermes" if chat else "compact")
        return cls(section, reward_fn, tok, limits, fmt)

    @property
    def tool_schemas(self) -> list[dict] | None:
        """What the chat template renders as the tools (hermes format only)."""
        if self.call_format != "hermes":
            return None
        return [t.schema for t in load_tools(self.section.tool_specs)]

    def driver(self, name: str) -> TrajectoryDriver:
        counts: Counter = Counter()
        if self.section.name == "tools":
            make_env = ToolBox(load_tools(self.section.tool_specs), FORMATS[self.call_format](), self.reward_fn,
                               timeout_s=self.section.tool_timeout_s, counts=counts)
        else:
            make_env = load_environment(self.section.name)
        return TrajectoryDriver(make_env, self.tok, self.limits, name=f"env ({name})", counts=counts)
