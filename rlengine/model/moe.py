"""Qwen3-MoE sparse block: softmax top-k router plus stacked experts.

Expert weights live stacked per layer so grouped-GEMM kernels and the decode path read them
without copies: w13 [E, 2F, C] (rows 0:F gate, F:2F up) and w2 [E, C, F] — the layout of
transformers 5's fused experts. Every expert computation goes through `moe_experts()`,
which dispatches on the implementation chosen at load time: "ref" (the plain-torch loop
over experts below, the trusted oracle) or "triton" (rlengine.kernels.fused_moe).

Routing replay: when `replay_ids` is set on the block (a [T, K] tensor of expert ids recorded
by the engine), the block uses those ids instead of its own top-k and still recomputes the
weights from its router logits, so gradients reach the router.

Dimension legend: T tokens, C hidden, F expert FFN, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MOE_IMPLS = ("ref", "triton")


def triton_available() -> bool:
    """True when the Triton kernels can launch here (triton is an optional dependency: the gpu extra)."""
    try:
        from rlengine.kernels import _triton
    except ImportError:
        return False
    return _triton.AVAILABLE


def select_experts(probs_TE: torch.Tensor, top_k: int, replay_ids_TK: torch.Tensor | None = None):
    """(probabilities [T, K], ids [T, K] int64) of the top-k experts, or of the replayed ids."""
    if replay_ids_TK is None:
        return torch.topk(probs_TE, top_k, dim=-1)
    ids_TK = replay_ids_TK.to(torch.int64)
    return probs_TE.gather(1, ids_TK), ids_TK


def route(router_logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool,
          replay_ids_TK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (fp32) top-k routing as in HF Qwen3-MoE -> (weights [T, K] in logits dtype, ids [T, K] int64)."""
    probs_TE = F.softmax(router_logits_TE, dim=-1, dtype=torch.float32)
    weights_TK, ids_TK = select_experts(probs_TE, top_k, replay_ids_TK)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK.to(router_logits_TE.dtype), ids_TK


def moe_experts_ref(x_TC: torch.Tensor, w13_EFC: torch.Tensor, w2_ECF: torch.Tensor,
                    topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor) -> torch.Tensor:
    """Plain-torch experts: loop over the experts that received tokens; differentiable in all inputs.

    Host sync: one .nonzero over the routing ids (the reference is not a hot path).
    """
    T, C = x_TC.shape
    ffn = w2_ECF.shape[2]
    out_TC = torch.zeros(T, C, dtype=torch.float32, device=x_TC.device)
    flat_ids = topk_ids_TK.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13_EFC.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tok = pairs // topk_ids_TK.shape[1]
        h = x_TC[tok] @ w13_EFC[e].t()
        h = F.silu(h[:, :ffn]) * h[:, ffn:]
        y = (h @ w2_ECF[e].t()) * topk_weights_TK.reshape(-1)[pairs].unsqueeze(1)
        out_TC = out_TC.index_add(0, tok, y.float())
    return out_TC.to(x_TC.dtype)


def moe_experts(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK, impl: str = "ref") -> torch.Tensor:
    """Expert computation [T, C] -> [T, C] through the chosen implementation ("ref" | "triton")."""
    if impl == "ref":
        return moe_experts_ref(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK)
    if impl == "triton":
        from rlengine.kernels.fused_moe import fused_moe

        return fused_moe(x_TC.contiguous(), w13_EFC, w2_ECF, topk_weights_TK.contiguous(), topk_ids_TK.contiguous())
    raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {impl!r}")


class SparseMoeBlock(nn.Module):
    """Router (gate) + stacked experts. Records the chosen ids in `last_ids` when `record_ids` is on."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 impl: str = "ref"):
        super().__init__()
        if impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {impl!r}")
        if impl == "triton" and not triton_available():
            raise ImportError("moe_impl 'triton' needs triton, which is not installed (pip install 'rlengine[gpu]'); "
                              "use moe_impl 'ref'")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.impl = impl
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.replay_ids: torch.Tensor | None = None   # [T, K] set by the caller for one forward
        self.record_ids = False
        self.last_ids: torch.Tensor | None = None      # [T, K] ids chosen in the last forward
        self.last_disagreement: torch.Tensor | None = None  # replayed forwards: fraction of tokens re-routed

    def forward(self, x_TC: torch.Tensor) -> torch.Tensor:
        logits_TE = self.gate(x_TC)
        weights_TK, ids_TK = route(logits_TE, self.top_k, self.norm_topk_prob, self.replay_ids)
        if self.replay_ids is not None:
            # how often this forward's own top-k set differs from the replayed one
            own = torch.topk(logits_TE.detach(), self.top_k, dim=-1).indices.sort(dim=-1).values
            self.last_disagreement = (own != ids_TK.sort(dim=-1).values).any(dim=-1).float().mean()
        if self.record_ids:
            self.last_ids = ids_TK
        return moe_experts(x_TC, self.w13, self.w2, weights_TK, ids_TK, self.impl)


def engine_routing(blocks: list[SparseMoeBlock], record: bool) -> None:
    """Prepare the blocks for an engine forward: route by their own top-k (any replay ids a learner
    left are cleared) and record the chosen ids in `last_ids` when `record`."""
    for block in blocks:
        block.record_ids, block.replay_ids = record, None


def recorded_routing(blocks: list[SparseMoeBlock]) -> torch.Tensor:
    """The ids the last forward routed each token to, stacked over blocks: [T, L_moe, K]."""
    return torch.stack([block.last_ids for block in blocks], dim=1)
