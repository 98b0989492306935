"""Prompt text -> the token ids the model sees: plain encoding, or the tokenizer's chat template.

With task.chat_template = true each problem's prompt becomes the messages
[{"role": "system", "content": task.system_prompt} (only when set), {"role": "user", "content": prompt}]
rendered by the tokenizer's own chat template with the generation prompt appended (the
assistant turn the model completes), exactly as transformers' apply_chat_template(...,
add_generation_prompt=True, tokenize=True) renders it. Without a template a prompt is encoded with the
tokenizer's special tokens (add_special_tokens=True: a Llama 3 base model gets its BOS), as vLLM and
transformers encode a text prompt. Rewards still see the raw prompt text.
Encodings are cached per prompt text (a GRPO job encodes the same prompts again and again).
"""

from __future__ import annotations

from rlengine.model.config import ConfigError
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.data.tasks import Task


class PromptEncoder:
    """Callable prompt text -> token ids (list[int]) for one job."""

    def __init__(self, tok: Tokenizer, *, chat_template: bool = False, system_prompt: str = "",
                 tools: list[dict] | None = None):
        """tools: JSON schemas the chat template renders (apply_chat_template(tools=...)); chats only."""
        if chat_template and getattr(tok, "chat_template", None) is None:
            raise ConfigError("task.chat_template = true, but the model's tokenizer has no chat template "
                              "(tokenizer_config.json 'chat_template' or chat_template.jinja); "
                              "set task.chat_template = false or use a chat model's checkpoint")
        self.tok, self.chat, self.system_prompt, self.tools = tok, chat_template, system_prompt, tools
        self._cache: dict[str, list[int]] = {}

    def messages(self, prompt: str) -> list[dict]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": prompt}]

    def __call__(self, prompt: str) -> list[int]:
        ids = self._cache.get(prompt)
        if ids is None:
            if self.chat:
                ids = list(self.tok.apply_chat_template(self.messages(prompt), add_generation_prompt=True,
                                                        tokenize=True, tools=self.tools))
            else:
                ids = self.tok.encode(prompt, add_special_tokens=True)
            self._cache[prompt] = ids
        return ids


def check_job_prompts(task: Task, extra_sets, encode: PromptEncoder, *, max_position_embeddings: int,
                      max_tokens: int) -> None:
    """Every prompt of the task (train and held-out) and of the named eval sets `extra_sets`, as `encode`
    renders it, leaves gen.max_tokens of room: DatasetError naming the ones that do not. One check for
    the CLI's preflight and the trainer."""
    limit = f"max_position_embeddings {max_position_embeddings} - gen.max_tokens {max_tokens}"
    room = max_position_embeddings - max_tokens
    if room < 1:  # no prompt can fit: the limit is the problem, not the prompts
        raise ConfigError(f"gen.max_tokens {max_tokens} leaves no room for a prompt: the model's context is "
                           f"max_position_embeddings {max_position_embeddings} tokens; give gen.max_tokens "
                           f"below {max_position_embeddings}")
    task.check_prompts(encode, room, limit=limit)
    for es in extra_sets:
        Task(f"eval set {es.name}", [], es.problems, task.reward_fn).check_prompts(encode, room, limit=limit)
