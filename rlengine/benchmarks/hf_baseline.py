"""The transformers side of `rlengine bench decode`: generate() on the same weights, two configurations.

  "eager"   dynamic cache, eager forward: what most comparisons use (HF_EAGER).
  "static"  static cache + torch.compile of the decode forward through transformers' own
            CompileConfig (mode reduce-overhead with inductor: the fairest configuration
            transformers offers on a GPU). On a CPU transformers does not compile unless told
            to; the benchmark tells it to (CompileConfig._compile_all_devices), and CPU tests
            use torch.compile's "eager" backend to stay fast. The label says which backend ran.
Per-step records: a streamer stamps the host clock each time generate() hands it a token (after
the step's host sync, which generate() makes anyway to test for finished sequences); the gaps
between consecutive new tokens are the gen-len - 1 decode steps, each with generate()'s own
per-step work (cache update, logits processors, stopping criteria). The benchmark's default
step time is the wall-clock difference of a gen-len-token and a 1-token call
(decode_rounds.py); the gaps are its cross-check, since under heavy load the two walls of a
difference can move apart. Ragged prompts are left-padded with an attention mask. Every
sequence's tokens are returned for the agreement check.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

HF_MODES = ("eager", "static")


def load_pair(model: str, dtype: torch.dtype, device: torch.device, workdir: str):
    """(our model, transformers model) with the same weights; a preset gets random weights (seed 0)."""
    from transformers import AutoModelForCausalLM

    from rlengine.model.config import preset
    from rlengine.model import Qwen3ForCausalLM, load_pretrained, save_pretrained

    moe_impl = "triton" if device.type == "cuda" else "ref"  # sync-free experts: capturable in CUDA graphs
    if Path(model).is_dir():
        ours, path = load_pretrained(model, dtype=dtype, device=device, moe_impl=moe_impl), model
    else:
        ours = Qwen3ForCausalLM(preset(model), dtype=dtype, device=device, moe_impl=moe_impl)
        path = save_pretrained(ours, Path(workdir) / "ckpt")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    return ours, hf


class _StepClock:
    """A generate() streamer that only stamps the time of each put(): the prompt, then one per new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFProvider:
    """transformers generate() in one of HF_MODES; step_s() times one batch."""

    def __init__(self, hf, mode: str, *, compile_backend: str = "inductor"):
        if mode not in HF_MODES:
            raise ValueError(f"HFProvider mode must be one of {HF_MODES}, got {mode!r}")
        self.hf, self.mode = hf, mode
        self.kwargs: dict = {}
        if mode == "static":
            from transformers import CompileConfig

            compile_config = CompileConfig(backend=compile_backend,
                                           mode="reduce-overhead" if compile_backend == "inductor" else None)
            if hf.device.type != "cuda":
                compile_config._compile_all_devices = True  # transformers compiles only on GPUs by default
            self.kwargs = dict(cache_implementation="static", compile_config=compile_config)
        self.label = ("HF dynamic cache, eager" if mode == "eager" else
                      f"HF static cache + torch.compile({compile_backend})")

    @torch.inference_mode()
    def step_times(self, prompts: list[list[int]], gen_len: int) -> tuple[list[float], list[list[int]]]:
        """Seconds of each of the gen_len - 1 decode steps, and the generated tokens of every sequence."""
        width = max(len(p) for p in prompts)
        device = self.hf.device
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        clock = _StepClock()
        out = self.hf.generate(ids, attention_mask=mask, max_new_tokens=gen_len, min_new_tokens=gen_len,
                               do_sample=False, pad_token_id=0, streamer=clock, **self.kwargs)
        new = clock.times[1:]  # times[0] is the prompt, handed over before the prefill
        return [b - a for a, b in zip(new, new[1:])], out[:, width:].tolist()

    def step_s(self, prompts: list[list[int]], gen_len: int) -> tuple[float, list[list[int]]]:
        """Mean seconds per decode step and the generated tokens of every sequence."""
        steps, tokens = self.step_times(prompts, gen_len)
        return sum(steps) / len(steps), tokens
