"""[env]: multi-turn rollouts. Which environment each sample runs in (rl/env/) and where its trajectory is cut.

name = "" keeps the single-turn job. name = "tools" is the tool environment (rl/env/tool_env.py) over
env.tools (built-in names or plugins "pkg.module:function"); any other name is a user environment
"pkg.module:Name" (rl/env/api.py). Plugins and tools are imported here, when the config is read, so a
bad one stops the job with one line before anything is built. A trajectory's budget after its prompt
(model and observation tokens) is gen.max_tokens, the length the memory plan sizes for.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlengine.model.config import ConfigError

ENV_NAMES = ("tools",)                 # built-in environments (besides "" = none)
CALL_FORMATS = ("auto", "hermes", "compact")


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvSection:
    """Multi-turn rollouts: the environment and its limits."""

    name: str = ""                       # "" = single-turn | tools | plugin "pkg.module:Name"
    tools: str | tuple[str, ...] = ()    # name = tools: built-in tool names or plugins, list or comma-separated
    call_format: str = "auto"            # tools: auto (hermes with task.chat_template, else compact) | hermes | compact
    max_turns: int = 4                   # model turns per trajectory
    max_turn_tokens: int = 0             # tokens per model turn; 0 = gen.max_tokens
    max_obs_tokens: int = 256            # tokens per observation (longer ones are cut, counted)
    tool_timeout_s: float = 5.0          # seconds per tool call; past it the call is answered with an error (counted)

    def __post_init__(self):
        if self.max_turns < 1 or self.max_obs_tokens < 1 or self.max_turn_tokens < 0:
            raise ConfigError(f"env.max_turns and env.max_obs_tokens must be >= 1 and env.max_turn_tokens >= 0 "
                              f"(0 = gen.max_tokens), got {self.max_turns}, {self.max_obs_tokens}, "
                              f"{self.max_turn_tokens}")
        if not self.tool_timeout_s > 0:
            raise ConfigError(f"env.tool_timeout_s must be > 0 seconds, got {self.tool_timeout_s}")
        if self.call_format not in CALL_FORMATS:
            raise ConfigError(f"env.call_format must be one of {', '.join(CALL_FORMATS)}, got {self.call_format!r}")
        if self.name and self.name not in ENV_NAMES and ":" not in self.name:
            raise ConfigError(f"env.name: unknown environment {self.name!r}; built-in: {', '.join(ENV_NAMES)}, or a "
                              "plugin 'package.module:Name'")
        if self.tool_specs and self.name != "tools":
            raise ConfigError(f"env.tools needs env.name = 'tools', got env.name = {self.name!r}")
        if self.name == "tools" and not self.tool_specs:
            raise ConfigError("env.name = 'tools' needs env.tools: built-in tool names or plugins "
                              "'pkg.module:function'")
        if ":" in self.name:
            from rlengine.rl.env.api import load_environment

            load_environment(self.name)
        if self.tool_specs:
            from rlengine.rl.env.tools import load_tools

            load_tools(self.tool_specs)

    @property
    def tool_specs(self) -> tuple[str, ...]:
        t = self.tools
        return tuple(s.strip() for s in t.split(",") if s.strip()) if isinstance(t, str) else tuple(t)
