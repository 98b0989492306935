"""Attention backends behind one plan()/run() protocol, and the choice between them."""

from __future__ import annotations

import torch

from rlengine.engine.attention.base import AttentionBackend
from rlengine.engine.attention.cpp_backend import CppBackend
from rlengine.engine.attention.flashinfer_backend import FlashInferBackend
from rlengine.engine.attention.invariant_backend import InvariantBackend
from rlengine.engine.attention.invariant_triton_backend import InvariantTritonBackend
from rlengine.engine.attention.torch_backend import TorchBackend
from rlengine.engine.attention.triton_backend import TritonBackend

BACKENDS = {"torch": TorchBackend, "cpp": CppBackend, "triton": TritonBackend, "flashinfer": FlashInferBackend,
            "invariant": InvariantBackend}
DEVICE_VARIANTS = {("invariant", "cuda"): InvariantTritonBackend}  # one name, the device's implementation
AUTO_ORDER = {"cuda": ("triton", "torch"), "cpu": ("cpp", "torch")}  # tested backends only


def resolve_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """The backend class for `name` ("auto" picks triton > torch on GPU, cpp > torch on CPU).

    FlashInfer is opt-in (attention_backend="flashinfer"): `auto` picks only backends the test
    suite checks against the torch oracle, and FlashInfer has had no such GPU run yet
    (tests/gpu/test_engine_sync_and_backends_gpu.py runs it when flashinfer is installed).
    Raises ValueError naming the backend and why it cannot run on this machine.
    """
    if name == "auto":
        order = AUTO_ORDER["cuda" if device.type == "cuda" else "cpu"]
        for cand in order:
            cls = BACKENDS[cand]
            if not hasattr(cls, "unavailable_reason") or cls.unavailable_reason(device) is None:
                return cls
        return TorchBackend
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")
    cls = DEVICE_VARIANTS.get((name, device.type), BACKENDS[name])
    reason = cls.unavailable_reason(device) if hasattr(cls, "unavailable_reason") else None
    if reason:
        raise ValueError(f"attention_backend={name!r} is unavailable on this machine: {reason}")
    return cls


__all__ = ["AUTO_ORDER", "AttentionBackend", "BACKENDS", "resolve_backend"]
