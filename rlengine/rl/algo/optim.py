"""The learner's optimizer: AdamW, optionally over fp32 master weights of the shared bf16 parameters.

Mixed precision kept compatible with one shared copy of the weights (DESIGN.md): the nn.Module's
parameters stay in the compute dtype (bf16 on GPU) and are what the engine decodes from and the
learner's forward/backward runs on. With master weights, AdamW steps fp32 copies (fp32 moments
too) and after each step writes the rounded result back into the bf16 parameters IN PLACE (same
storage: the engine and captured CUDA graphs see it at the next decode step). Without them a bf16
weight of 0.02 (ulp ~1.2e-4) does not move at all under the paper's learning rate of 1e-6.
Gradients accumulate in fp32: after each micro-batch's backward, accumulate() adds its bf16
gradient into the master's fp32 .grad and frees the bf16 one, so micro-batches never sum in bf16.

Memory per parameter (bytes): compute weights 2 (bf16) + master 4 + Adam moments 8 + fp32 grad 4
(+ the transient bf16 grad of one micro-batch, 2) = 18-20, against 16 for plain fp32 training
(4 + 8 + 4). analysis.memory.training_bytes_per_param gives the same numbers for the memory plan.
"""

from __future__ import annotations

import torch


def use_master_weights(mode: str, dtype: torch.dtype) -> bool:
    """train.master_weights -> bool: auto = fp32 masters whenever the compute dtype is not fp32/fp64."""
    if mode not in ("auto", "fp32", "none"):
        raise ValueError(f"train.master_weights must be auto|fp32|none, got {mode!r}")
    if mode == "auto":
        return dtype not in (torch.float32, torch.float64)
    return mode == "fp32" and dtype != torch.float64


class LearnerOptimizer:
    """AdamW over `params` (plain) or over fp32 masters of them (masters=True).

    .opt is the torch AdamW (its state_dict is what checkpoints save); .grad_params are the tensors
    holding the gradients to clip (the masters, or the parameters themselves); .master_params the
    fp32 masters aligned with `params` (None without masters).
    """

    def __init__(self, params, *, lr: float, betas, weight_decay: float, masters: bool):
        self.params = [p for p in params if p.requires_grad]
        self.master_params = None
        if masters:
            self.master_params = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self.grad_params = self.master_params if masters else self.params
        self.opt = torch.optim.AdamW(self.grad_params, lr=lr, betas=betas, weight_decay=weight_decay)

    @torch.no_grad()
    def accumulate(self) -> None:
        """After each micro-batch's backward: add the parameters' grads into the fp32 masters' .grad
        and free them (no-op without masters, where autograd accumulates into .grad itself)."""
        if self.master_params is None:
            return
        for p, m in zip(self.params, self.master_params):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.to(torch.float32, copy=True)
            else:
                m.grad.add_(p.grad)
            p.grad = None

    @property
    def param_groups(self):
        return self.opt.param_groups

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """AdamW step; with masters, then write each rounded master into its parameter in place."""
        self.opt.step()
        if self.master_params is not None:
            for p, m in zip(self.params, self.master_params):
                p.copy_(m)

    @torch.no_grad()
    def sync_params_from_masters(self) -> None:
        """Write the (restored) masters into the shared parameters, rounded, in place."""
        if self.master_params is not None:
            for p, m in zip(self.params, self.master_params):
                p.copy_(m)
