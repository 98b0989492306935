"""Batch-invariant MoE block: routing and expert sums whose bits depend only on the token's own row.

The default block (moe.py) has three batch-dependent orders: the router's linear and softmax pick
kernels by row count, the experts' GEMMs tile by how many tokens each expert received this step, and
the top-k outputs are added with index_add in whatever order the grouped rows arrive. Here:
- router: batch_invariant.linear for the logits, then softmax as exp(z - logsumexp(z)) with the
  fixed-order fp32 logsumexp and the per-element exp (top-k and the replay gather are selections,
  exact whatever the batch);
- norm_topk_prob: the K weights summed slot by slot, 0 .. K-1 (a reduction kernel over a short last
  dim may vectorise across rows and change its order with the row count);
- experts: each routed row goes through batch_invariant.linear / silu_and_mul, whose per-row order
  does not depend on how many rows the expert got;
- combination: sum over slots in slot order, in fp32, as elementwise multiply-adds.
Grouping rows by expert is a gather, and putting them back an index_copy: both exact. Routing replay
(block.replay_ids) and routing records (block.record_ids) work as in the default block.
Autograd: every op above is differentiable (the router's softmax through the reference softmax),
so the learner's forward is this code with gradients.

Dimension legend: T tokens, C hidden, F expert FFN, E experts, K top-k, N = T*K routed rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlengine.model import batch_invariant as inv
from rlengine.model.moe import select_experts


def _softmax_kernel(z_TE: torch.Tensor) -> torch.Tensor:
    z = z_TE.float().contiguous()
    return inv.exp(z - inv.logsumexp(z)[:, None])


def _softmax_ref(z_TE: torch.Tensor) -> torch.Tensor:
    return F.softmax(z_TE, dim=-1, dtype=torch.float32)


def router_probs(x_TC: torch.Tensor, gate_w_EC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(router logits [T, E] in x's dtype, softmax probabilities [T, E] fp32), each row on its own."""
    logits_TE = inv.linear(x_TC, gate_w_EC)
    return logits_TE, inv._apply(_softmax_kernel, _softmax_ref, logits_TE)


def route(probs_TE: torch.Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype,
          replay_ids_TK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the probabilities (or the replayed ids) -> (weights [T, K] in dtype, ids [T, K] int64)."""
    weights_TK, ids_TK = select_experts(probs_TE, top_k, replay_ids_TK)
    if norm_topk_prob:
        total_T = weights_TK[:, 0]
        for k in range(1, top_k):
            total_T = total_T + weights_TK[:, k]
        weights_TK = weights_TK / total_T[:, None]
    return weights_TK.to(dtype), ids_TK


def experts(x_TC: torch.Tensor, w13_EFC: torch.Tensor, w2_ECF: torch.Tensor, weights_TK: torch.Tensor,
            ids_TK: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) -> [T, C] in x's dtype, slots added in order.

    Host sync: one bincount read (which experts got rows), as in the reference loop."""
    T, K = ids_TK.shape
    if T == 0:
        return torch.zeros_like(x_TC)
    flat_N = ids_TK.reshape(-1)
    order_N = torch.argsort(flat_N, stable=True)
    counts = torch.bincount(flat_N, minlength=w13_EFC.shape[0]).tolist()
    pieces, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = order_N[start:start + n] // K
        start += n
        pieces.append(inv.linear(inv.silu_and_mul(inv.linear(x_TC[tok], w13_EFC[e])), w2_ECF[e]))
    y_sorted_NC = torch.cat(pieces)
    y_NC = torch.empty_like(y_sorted_NC).index_copy(0, order_N, y_sorted_NC)
    y_TKC = (y_NC * weights_TK.reshape(-1, 1)).view(T, K, -1)
    out_TC = y_TKC[:, 0].float()
    for k in range(1, K):
        out_TC = out_TC + y_TKC[:, k].float()
    return out_TC.to(x_TC.dtype)


def moe_block(block, x_TC: torch.Tensor) -> torch.Tensor:
    """SparseMoeBlock.forward in batch-invariant mode (same routing replay and records)."""
    logits_TE, probs_TE = router_probs(x_TC, block.gate.weight)
    weights_TK, ids_TK = route(probs_TE, block.top_k, block.norm_topk_prob, x_TC.dtype, block.replay_ids)
    if block.replay_ids is not None:
        own = torch.topk(probs_TE.detach(), block.top_k, dim=-1).indices.sort(dim=-1).values
        block.last_disagreement = (own != ids_TK.sort(dim=-1).values).any(dim=-1).float().mean()
    if block.record_ids:
        block.last_ids = ids_TK
    return experts(x_TC, block.w13, block.w2, weights_TK, ids_TK)
