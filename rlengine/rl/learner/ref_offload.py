"""Host-resident KL reference (train.ref_offload): decoder layers kept on the host, streamed per layer.

The frozen reference is a full copy of the policy; with ref_offload its decoder layers' weights
live in host memory (pinned on CUDA, so the copies are asynchronous) and each layer's weights are
copied to the device just before the layer runs and dropped right after: the device holds the
embedding, the LM head, the final norm and ONE decoder layer of the reference instead of all of it
(analysis.memory.reference_device_params counts the same). Simplification: no prefetch, so the
copy of layer i + 1 does not overlap layer i's compute (the reference forward runs once per
micro-batch, without autograd). On a CPU the host is the device: the option works (every layer is
still copied per forward, which the tests use to see the streaming) but saves nothing.
"""

from __future__ import annotations

import torch
from torch import nn


class HostStreamedLayers:
    """Moves `model`'s decoder layers to the host and streams them back per forward (hooks)."""

    def __init__(self, model: nn.Module):
        self.device = model.device
        self.pinned = self.device.type == "cuda"
        self.fetches = 0          # layer copies made (one per layer per reference forward)
        self.resident = 0         # layers whose weights are on the device right now (0 or 1 outside tests)
        self.peak_resident = 0
        self._host: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        for layer in model.model.layers:
            pairs = []
            for p in layer.parameters():
                host = p.data.to("cpu", copy=True)
                if self.pinned:
                    host = host.pin_memory()
                p.data = host
                pairs.append((p, host))
            self._host[id(layer)] = pairs
            layer.register_forward_pre_hook(self._fetch)
            layer.register_forward_hook(self._release)

    @property
    def host_tensors(self) -> list[torch.Tensor]:
        """The host copies of every streamed weight (what the parameters hold between forwards)."""
        return [h for pairs in self._host.values() for _, h in pairs]

    def _fetch(self, layer: nn.Module, args) -> None:
        # copy=True: on a CPU device .to() would otherwise hand back the host tensor itself
        for p, host in self._host[id(layer)]:
            p.data = host.to(self.device, non_blocking=self.pinned, copy=True)
        self.fetches += 1
        self.resident += 1
        self.peak_resident = max(self.peak_resident, self.resident)

    def _release(self, layer: nn.Module, args, output) -> None:
        # the device copies are freed here; the caching allocator orders their reuse on the stream
        for p, host in self._host[id(layer)]:
            p.data = host
        self.resident -= 1
