"""Decode graphs that follow the parameters' storage.

A captured decode graph replays fixed addresses. One process and DDP replicas never move their
parameters, so they capture once; FSDP allocates the unsharded storage anew at each unshard, so
the engines' graphs are re-captured whenever the storage they were captured on has moved. The
loop calls refresh() inside `dist.unsharded(model)`, before every rollout and evaluation.
"""

from __future__ import annotations


class EngineGraphs:
    """The decode graphs of `engines` (LLMs over `model`), kept on the model's current storage."""

    def __init__(self, model, engines):
        self.model, self.engines = model, list(engines)
        self.weights: tuple[int, ...] | None = None   # data_ptr of every parameter at the last capture
        self.recaptures = 0                           # engines re-captured after a storage move

    def refresh(self) -> None:
        """(Re-)capture every engine's decode graphs when the parameters' storage differs from the one
        they were captured on (a no-op on a CPU and with enforce_eager: there is nothing to capture)."""
        weights = tuple(p.data_ptr() for p in self.model.parameters())
        if weights == self.weights:
            return
        for llm in self.engines:
            graphs = llm.runner.graphs
            if graphs is not None and self.weights is not None:
                llm._use_decode_graphs(graphs.graph_cls, graphs.sizes)  # drops the stale captures
                self.recaptures += 1
            llm.capture_decode_graphs()
        self.weights = weights

    def forget(self) -> None:
        """Capture anew at the next refresh() (the engines' graph settings were changed by hand)."""
        self.weights = None
