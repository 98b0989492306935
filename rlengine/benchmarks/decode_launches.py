"""`rlengine bench decode --count-launches`: the device launches of one decode step, by kind.

Kinds: Triton kernels (by name), torch ops that become device kernels (a TorchDispatchMode over
compute ops: views, metadata and allocations without a fill are not launches), and copies
(copy_, _to_copy, clone). Counted for an eager step and for a CUDA-graph step, whose launches are
split into those inside the replay (the graph's kernels) and those the host issues around it.
Per-layer count and per-step constant come from two models that differ only in depth:
per_layer = (n(L2) - n(L1)) / (L2 - L1), constant = n(L1) - L1 * per_layer.

CPU (no device): the Triton backend's path under TRITON_INTERPRET=1 (the model's fast path set to
kernels/fused_norm.py, as on a GPU), the graph through cuda_graph.StaticReplay, split planning
with a simulated SM count (132, an H100/H200) and max_model_len 40,960, so the bucket capacity
and split classes are the GPU's. Host-to-device staging and device-to-host output copies do not
run on a CPU (the staging buffer is the device buffer): DEVICE_ONLY adds them.
GPU: the per-kernel counts come from torch.profiler instead (decode_gpu_profile.py, tools/gpu_check.sh
profile; untested: no device in the session that wrote it). The model is a small Qwen3 with Qwen3-0.6B's head
layout (H 16, Hkv 8), so the interpreter stays fast; launch counts do not depend on widths.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlengine.model.config import ConfigError, ModelConfig

COPIES = {"copy_", "_to_copy", "clone", "_copy_from", "lift_fresh_copy"}
NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "set_", "resize_",
             "_local_scalar_dense", "is_nonzero", "equal"}  # allocations, and host reads of CPU values
# Per step on a GPU only: the staging upload (H2D), and for eager steps the output copy (D2H; a graph
# step's D2H copy takes the place of the CPU's copy of the packed outputs, counted).
DEVICE_ONLY = {"eager": 2, "graph": 1}


@dataclass
class Launches:
    """Launches of one step, by kind and name."""

    triton: Counter = field(default_factory=Counter)  # Triton kernel name -> launches
    torch: Counter = field(default_factory=Counter)   # aten / custom op -> launches
    copies: Counter = field(default_factory=Counter)  # copy op -> launches
    replays: int = 0                                   # graph replays (one launch each, from the host)

    @property
    def total(self) -> int:
        return sum(self.triton.values()) + sum(self.torch.values()) + sum(self.copies.values()) + self.replays

    def kinds(self) -> dict:
        return {"triton": sum(self.triton.values()), "torch": sum(self.torch.values()),
                "copies": sum(self.copies.values()), "replays": self.replays, "total": self.total}


def _launches_nothing(func) -> bool:
    """Views (their returns alias an input, nothing written), metadata and bare allocations."""
    if func.overloadpacket.__name__ in NO_KERNEL:
        return True
    schema = func._schema
    if schema.is_mutable:  # in-place and out= ops write memory
        return False
    return not schema.returns or all(r.alias_info is not None for r in schema.returns)


class LaunchCounter(TorchDispatchMode):
    """Counts compute ops and copies (TorchDispatchMode) and Triton launches (interpreter hook) into
    `outside`, or into `inside` while a graph replays (set by the counted replay class)."""

    def __init__(self, run_kernels: bool = False):
        super().__init__()
        self.run_kernels = run_kernels  # False: count a Triton launch, skip its body (its outputs keep garbage)
        self.outside, self.inside = Launches(), Launches()
        self.in_graph = False
        self._paused = 0

    @property
    def target(self) -> Launches:
        return self.inside if self.in_graph else self.outside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused and not _launches_nothing(func):
            name = func.overloadpacket.__name__
            (self.target.copies if name in COPIES else self.target.torch)[name] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def triton_hook(self):
        """Count interpreted Triton launches; the interpreter's own tensor copies are not launches."""
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run
        counter = self

        def counted(fn_self, *args, grid, warmup, **kwargs):
            if warmup:
                return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
            counter.target.triton[fn_self.fn.__name__] += 1
            if not counter.run_kernels:
                return None
            counter._paused += 1
            try:
                return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                counter._paused -= 1

        InterpretedFunction.run = counted
        try:
            yield self
        finally:
            InterpretedFunction.run = run


def counted_replay(counter: LaunchCounter) -> type:
    """cuda_graph.StaticReplay whose replays count as one host launch, their kernels as `inside`."""
    from rlengine.engine.cuda_graph import StaticReplay

    class CountedReplay(StaticReplay):
        def capture(self, fn):
            counter._paused += 1
            try:
                super().capture(fn)
            finally:
                counter._paused -= 1

        def replay(self):
            counter.outside.replays += 1
            counter.in_graph = True
            try:
                return super().replay()
            finally:
                counter.in_graph = False

    return CountedReplay


def count_config(layers: int) -> ModelConfig:
    """A small Qwen3 with Qwen3-0.6B's head layout (H 16, Hkv 8, q/k norm, tied embeddings)."""
    return ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=16, max_position_embeddings=40960,
                       tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@contextlib.contextmanager
def _gpu_path_on_cpu():
    """The model's fast path with the GPU's kernels (kernels/fused_norm.py under the interpreter)."""
    from rlengine.model import ops, qwen3

    before = qwen3.fused_ops_for
    qwen3.fused_ops_for = lambda device: ops.triton_ops()
    try:
        yield
    finally:
        qwen3.fused_ops_for = before


def _engine(layers: int, batch: int, *, context: int, max_model_len: int, num_sms: int | None, seed: int = 0,
            sampling: str = "greedy", decode_kernels: str = "torch"):
    from rlengine import LLM, SamplingParams
    from rlengine.model.qwen3 import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(count_config(layers))
    pages = batch * (-(-(context + 8) // 16)) + 2
    llm = LLM(model, max_num_seqs=batch, max_model_len=max_model_len, attention_backend="triton",
              block_size=16, num_kv_blocks=pages, enforce_eager=True, decode_kernels=decode_kernels)
    if num_sms is not None:
        llm.backend.plan_for_sms(num_sms)
    gen = torch.Generator().manual_seed(seed + 1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True) if sampling == "greedy" else \
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True)
    for _ in range(batch):
        llm.add_request(torch.randint(3, 500, (context,), generator=gen).tolist(), params)
    return llm


def count_step(layers: int, batch: int, *, context: int = 32, max_model_len: int = 40960,
               num_sms: int | None = 132, run_kernels: bool = False, sampling: str = "greedy",
               decode_kernels: str = "torch") -> dict:
    """Launches of one eager and one graph decode step (CPU: interpreter + stand-in) ->
    {"eager": Launches, "graph": (outside Launches, inside Launches), "splits": graph step's KV splits}.

    run_kernels=False (default): Triton launches are counted and their bodies skipped, so the step's
    numbers are garbage but its launches are the path's (the interpreter runs one program at a time:
    a B_act 64 step would take minutes). The prefill runs the CPU kernels, uncounted. sampling: "greedy"
    or "top_p" (temperature 0.8, top-p 0.9). decode_kernels: the engine's decode layer path (torch | fused).
    """
    llm = _engine(layers, batch, context=context, max_model_len=max_model_len, num_sms=num_sms, sampling=sampling,
                  decode_kernels=decode_kernels)
    llm.step()  # prefill
    with _gpu_path_on_cpu():
        counter = LaunchCounter(run_kernels)
        with counter.triton_hook(), counter:
            llm.step()  # first decode: lazily built state
            counter.outside = Launches()
            llm.step()
        eager = counter.outside
        counter = LaunchCounter(run_kernels)
        with counter.triton_hook(), counter:
            graphs = llm._use_decode_graphs(counted_replay(counter))
            llm.step()  # captures (uncounted) and replays
            counter.outside, counter.inside = Launches(), Launches()
            llm.step()
        if graphs.num_replays != 2:
            raise RuntimeError(f"count_step: the graph steps replayed {graphs.num_replays} times, not 2")
    capacity = llm.backend.splits(batch, llm.runner.inputs.max_pages)
    return {"eager": eager, "graph": (counter.outside, counter.inside), "splits": llm.backend.num_splits,
            "capacity_splits": capacity}


def _per_layer(a: int, b: int, la: int, lb: int) -> tuple[float, float]:
    per = (b - a) / (lb - la)
    return per, a - la * per


def launch_table(batches=(1, 64), layers=(2, 4), **kw) -> list[dict]:
    """One row per B_act: per-layer launches and per-step constants, eager and graph."""
    rows = []
    for b in batches:
        r = {L: count_step(L, b, **kw) for L in layers}
        l1, l2 = layers
        e_per, e_const = _per_layer(r[l1]["eager"].total, r[l2]["eager"].total, l1, l2)
        g_per, g_const = _per_layer(r[l1]["graph"][1].total, r[l2]["graph"][1].total, l1, l2)
        out1 = r[l1]["graph"][0]
        top_p = count_step(l1, b, sampling="top_p", **kw)
        rows.append(dict(
            b_act=b, eager_per_layer=e_per, eager_constant=e_const, graph_per_layer=g_per, graph_inside_constant=g_const,
            graph_outside=out1.total, graph_outside_gpu=out1.total + DEVICE_ONLY["graph"], kv_splits=r[l1]["splits"],
            capacity_splits=r[l1]["capacity_splits"], eager_constant_top_p=top_p["eager"].total - l1 * e_per,
            graph_inside_constant_top_p=top_p["graph"][1].total - l1 * g_per, graph_outside_top_p=top_p["graph"][0].total,
            eager_by_kind={L: r[L]["eager"].kinds() for L in layers},
            graph_outside_by_kind=out1.kinds(), graph_inside_by_kind={L: r[L]["graph"][1].kinds() for L in layers},
            eager_ops=_names(r[l1]["eager"]), graph_inside_ops=_names(r[l1]["graph"][1]), graph_outside_ops=_names(out1)))
    return rows


def _names(n: Launches) -> dict:
    return {"triton": dict(n.triton), "torch": dict(n.torch), "copies": dict(n.copies), "replays": n.replays}


def _cpu_report(args) -> int:
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("--count-launches on a CPU runs the Triton path under the interpreter: "
                          "run it with TRITON_INTERPRET=1")
    layers = (2, 4)
    rows = launch_table(tuple(args.batches), layers, num_sms=args.sms, max_model_len=args.max_model_len,
                        context=args.prompt_len, decode_kernels=args.decode_kernels)
    cols = ["b_act", "eager_per_layer", "eager_constant", "graph_per_layer", "graph_inside_constant",
            "graph_outside", "graph_outside_gpu", "kv_splits", "capacity_splits", "eager_constant_top_p",
            "graph_inside_constant_top_p", "graph_outside_top_p"]
    print(f"launches of one decode step, decode kernels {args.decode_kernels} (CPU: Triton interpreter, graph "
          f"stand-in, {args.sms} simulated SMs, max_model_len {args.max_model_len}, context {args.prompt_len})")
    print("  ".join(f"{c:>16}" for c in cols))
    for row in rows:
        print("  ".join(f"{row[c]:>16}" for c in cols))
    print(f"per_layer / constant from {layers[0]} and {layers[1]} layers; *_constant: outside the layers; graph_outside:"
          f" host launches around the replay (the replay counts 1; *_gpu adds the H2D upload); kv_splits: the"
          f" graph step's splits at this context, capacity_splits: a graph planned for max_model_len; *_top_p:"
          f" temperature 0.8, top-p 0.9 instead of greedy")
    path = Path(args.out) / "decode_launches.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows, "device_only": DEVICE_ONLY, "sms": args.sms,
                                "decode_kernels": args.decode_kernels,
                                "max_model_len": args.max_model_len}, indent=1, default=str))
    print(f"wrote {path}")
    return 0


def main(args) -> int:
    """Entry of --count-launches (args from rlengine.benchmarks.decode's parser)."""
    if args.device != "cpu":
        raise ConfigError("--count-launches counts on the CPU (--device cpu); on a GPU the per-kernel table "
                          "comes from the profiler: tools/gpu_check.sh profile (rlengine.benchmarks.decode_gpu_profile)")
    return _cpu_report(args)
