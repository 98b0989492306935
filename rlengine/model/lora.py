"""LoRA adapters on the shared decoder: y = x W + s (x A) B, applied unmerged on every path.

The adapters live on the one nn.Module tree the engine and the learner share (DESIGN.md), so an
optimizer step on them is what the engine decodes with at its next step: no merge, no copy. Targets
take PEFT's names (q_proj ... down_proj, or all-linear); rlengine fuses q/k/v into qkv_proj and
gate/up into gate_up_proj, so one LoraAdapter serves one rlengine projection and holds the targets
fused into it:
- lora_A [n*r, C]: the n targets' A matrices stacked (one GEMM x A^T for all of them), stored right
  behind the projection's frozen W in one allocation (colocate): the engine's no-grad path computes
  x [W; A]^T, base output and x A^T, in one GEMM (LoraAdapter.project);
- lora_B [O, n*r]: block-diagonal, target i's B in its output rows and its r columns, zeros
  elsewhere. The differentiable paths multiply by a fixed 0/1 mask, so the off-block zeros get no
  gradient and stay exactly zero under AdamW (zero grad, zero moments, decay of 0 is 0); the engine's
  no-grad path uses lora_B as it is (the same numbers). Untargeted slices (k_proj when only q and v are
  targeted) are all-zero rows of B. The wasted work is O * (n-1) * r MACs per token, small next to
  the base projection's O * C at r << C.
Simplification: the targets fused into one projection share one dropout mask on x (PEFT draws one per
target); equal in distribution per target and identical without dropout, the RL default.
The scale s = lora_alpha / r (PEFT without rslora); the learner's and the batch-invariant paths add the
delta as y + d * s, two correctly rounded elementwise ops, so the vector body and scalar tail of torch's
loops give the same bits (the batch-invariant mode relies on that); the engine's fast path adds s * d
into the B GEMM's output in place, one rounding (within the engine-learner bound, not bitwise).
Init as PEFT: A kaiming-uniform(a=sqrt(5)), B zeros.
MoE experts take no adapters (ConfigError); attention projections of an MoE model may.
modules_to_save (PEFT's names; rlengine takes "lm_head" and "embed_tokens"): the module is replaced by a
SavedHead (SavedEmbedding) holding the frozen base and a trainable full copy of it, as PEFT's
ModulesToSaveWrapper. On a base with tied embeddings, a saved lm_head alone is an untied copy (PEFT without
ensure_weight_tying: the input embeddings stay the base); a saved embed_tokens with ensure_weight_tying
(what rlengine's own specs set) is one trainable copy that the head reads too, as PEFT ties them, so the
pair trains as full fine-tuning trains the tied matrix. The engine and the learner both read
lm_head.weight / embed_tokens' weight, which is the copy (the same tensor: no sync); adapters_disabled
gives the base.

Dimension legend: T tokens, C input features, O output features, r rank, n targets fused in one projection.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rlengine.model.config import ConfigError, ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# rlengine projection -> (where it lives, the PEFT/HF projections fused into it, in output order)
PROJECTIONS = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
               "o_proj": ("self_attn", ("o_proj",)),
               "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
               "down_proj": ("mlp", ("down_proj",))}
SAVE_MODULES = ("embed_tokens", "lm_head")  # modules_to_save rlengine trains as full copies (PEFT's names)
ADAPTER_ATTR = {"qkv_proj": "qkv_lora", "o_proj": "o_lora", "gate_up_proj": "gate_up_lora", "down_proj": "down_lora"}


def resolve_targets(names) -> tuple[str, ...]:
    """PEFT target names (a list, or "all-linear" alone) -> the HF projections targeted, in TARGETS order.
    ConfigError naming an unknown target."""
    names = (names,) if isinstance(names, str) else tuple(names)
    if not names:
        raise ConfigError(f"model.lora_target_modules is empty; name some of {', '.join(TARGETS)} or all-linear")
    if "all-linear" in names:
        if len(names) > 1:
            raise ConfigError("model.lora_target_modules: all-linear stands alone (it already names every projection)")
        return TARGETS
    bad = [n for n in names if n not in TARGETS]
    if bad:
        raise ConfigError(f"model.lora_target_modules: unknown target module(s) {', '.join(map(repr, bad))}; "
                          f"allowed: {', '.join(TARGETS)}, all-linear")
    return tuple(t for t in TARGETS if t in names)


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """One adapter set: rank, alpha, dropout and the HF projections it targets."""

    r: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")  # resolved names (resolve_targets)
    modules_to_save: tuple[str, ...] = ()  # trainable full copies (SAVE_MODULES), PEFT's modules_to_save
    ensure_weight_tying: bool = False  # PEFT's: a saved embed_tokens is also the head of a tied base

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ConfigError(f"model.lora_r must be an integer >= 1, got {self.r!r}")
        if not self.alpha > 0:
            raise ConfigError(f"model.lora_alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora_dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "targets", resolve_targets(self.targets))
        saved = (self.modules_to_save,) if isinstance(self.modules_to_save, str) else tuple(self.modules_to_save or ())
        bad = [m for m in saved if m not in SAVE_MODULES]
        if bad:
            raise ConfigError(f"model.lora_modules_to_save: {', '.join(map(repr, bad))} is not supported; "
                              f"allowed: {', '.join(SAVE_MODULES)} (or empty)")
        object.__setattr__(self, "modules_to_save", tuple(dict.fromkeys(saved)))

    def ties(self, cfg: ModelConfig) -> bool:
        """One trained copy for the embeddings and the head (ensure_weight_tying on a tied base)."""
        return self.ensure_weight_tying and cfg.tie_word_embeddings and "embed_tokens" in self.modules_to_save

    @property
    def scale(self) -> float:
        return self.alpha / self.r


def check_lora_fits(cfg: ModelConfig, spec: LoraSpec) -> None:
    """ConfigError when the spec targets MoE experts (gate/up/down on a model with sparse layers)."""
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    mlp = [t for t in spec.targets if t in MLP_TARGETS]
    if moe and mlp:
        raise ConfigError(f"model.lora_target_modules: LoRA on MoE experts is not supported ({', '.join(mlp)} on "
                          f"the sparse layers of a {cfg.model_type} MoE model); target the attention projections "
                          "(q_proj, k_proj, v_proj, o_proj)")


class LoraAdapter(nn.Module):
    """The adapters of one rlengine projection [O, C] whose output splits into `slices` (one per fused
    HF projection); `targeted` says which slices carry an adapter. See the module docstring."""

    def __init__(self, in_features: int, slices: list[int], targeted: list[bool], spec: LoraSpec):
        super().__init__()
        self.r, self.scale = spec.r, spec.scale
        self.slices, self.targeted = list(slices), list(targeted)
        n, O = sum(targeted), sum(slices)
        self.lora_A = nn.Parameter(torch.empty(n * spec.r, in_features))
        self.lora_B = nn.Parameter(torch.zeros(O, n * spec.r))
        mask = torch.zeros(O, n * spec.r)
        for row0, col0, rows in self.blocks():
            mask[row0:row0 + rows, col0:col0 + spec.r] = 1.0
        self.register_buffer("mask", mask, persistent=False)
        self.block_list = tuple(v for block in self.blocks() for v in block)  # flat, for FusedOps.lora
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.enabled = True  # adapters_disabled() switches it off (the KL reference: the base model)
        self._joint_key: tuple | None = None  # (W, A addresses) that _joint last checked, and its answer
        self._joint_ok = False

    def blocks(self):
        """(first output row, first column of A's rows / B's columns, rows) of each targeted slice."""
        row0, col0 = 0, 0
        for rows, on in zip(self.slices, self.targeted):
            if on:
                yield row0, col0, rows
                col0 += self.r
            row0 += rows

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        """PEFT's init: each target's A kaiming-uniform(a=sqrt(5)) (bound 1/sqrt(C)), B zeros."""
        bound = 1.0 / math.sqrt(self.lora_A.shape[1])
        a = (torch.rand(self.lora_A.shape, generator=gen, dtype=torch.float32) * 2 - 1) * bound
        self.lora_A.copy_(a)
        self.lora_B.zero_()

    def forward(self, x_TC: torch.Tensor, y_TO: torch.Tensor) -> torch.Tensor:
        """The differentiable torch path: y + (dropout(x) A^T) (B * mask)^T * s."""
        if not self.enabled:
            return y_TO
        d = F.linear(F.linear(self.dropout(x_TC), self.lora_A), self.lora_B * self.mask)
        return y_TO + d * self.scale

    def fused(self, x_TC: torch.Tensor, y_TO: torch.Tensor, linear, lora=None) -> torch.Tensor:
        """The engine's no-grad path with the projections' kernel choice `linear(x, w)` (FusedOps.linear):
        one GEMM for the stacked A, then the block-diagonal B's product added to y with the scale (y + s * d):
        by `lora.expand` (FusedOps.lora) where given, else one GEMM for B whose product is added into y IN
        PLACE (y is the projection's fresh output)."""
        if not self.enabled:
            return y_TO
        t_TJ = linear(x_TC, self.lora_A)
        if lora is not None:
            return lora.expand(y_TO, t_TJ, self.lora_B, self.scale, self.r, self.block_list)
        return y_TO.add_(linear(t_TJ, self.lora_B), alpha=self.scale)

    def project(self, x_TC: torch.Tensor, w_OC: torch.Tensor, linear, lora=None) -> torch.Tensor:
        """The engine's no-grad path for a bias-free projection with its adapter: x W^T + s (x A^T) B^T
        [T, O] in the compute dtype, with `linear(x, w)` (FusedOps.linear, the kernel choice). Where A
        sits right behind W in one allocation (colocate) one GEMM on [W; A] gives x W^T and x A^T
        together (lora.joint: under W's kernel choice); then lora.expand (FusedOps.lora) adds s (x A^T) B^T
        to the first part, or, without it, the B GEMM's output takes y + s * d in place. Elsewhere (moved
        or sharded parameters) fused()."""
        if not self.enabled:
            return linear(x_TC, w_OC)
        if not self._joint(w_OC):
            return self.fused(x_TC, linear(x_TC, w_OC), linear, lora)
        O, C = w_OC.shape
        joint_JC = w_OC.as_strided((O + self.lora_A.shape[0], C), (C, 1))  # [W; A]
        if lora is not None:
            return lora.expand(lora.joint(x_TC, joint_JC, w_OC), None, self.lora_B, self.scale, self.r,
                               self.block_list)  # [y | t]
        yx_TJ = linear(x_TC, joint_JC)  # [T, O + n*r]
        d_TO = linear(yx_TJ[:, O:], self.lora_B)
        return torch.add(yx_TJ[:, :O], d_TO, alpha=self.scale, out=d_TO)

    def _joint(self, w_OC: torch.Tensor) -> bool:
        """Whether A's rows follow W's in W's own storage ([W; A] is one [O + n*r, C] tensor); checked
        again only when either address changes (no extra cost per step)."""
        A = self.lora_A
        key = (w_OC.data_ptr(), A.data_ptr())
        if key != self._joint_key:
            self._joint_key = key
            self._joint_ok = (A.dtype == w_OC.dtype and A.device == w_OC.device and w_OC.is_contiguous()
                              and A.is_contiguous() and A.shape[1] == w_OC.shape[1] and w_OC.dim() == 2
                              and A.untyped_storage().data_ptr() == w_OC.untyped_storage().data_ptr()
                              and A.data_ptr() == w_OC.data_ptr() + w_OC.numel() * w_OC.element_size())
        return self._joint_ok

    def invariant(self, x_TC: torch.Tensor, y_TO: torch.Tensor, inv_linear) -> torch.Tensor:
        """The batch-invariant path (both sides, with or without autograd): the invariant linear twice."""
        if not self.enabled:
            return y_TO
        return y_TO + inv_linear(inv_linear(self.dropout(x_TC), self.lora_A), self.lora_B * self.mask) * self.scale


class SavedHead(nn.Module):
    """PEFT's modules_to_save for the LM head: the frozen base head (original_module; with tied embeddings
    its weight is embed_tokens') and a trainable full copy (modules_to_save), or, tied (`tied`: a saved
    embedding's copy), that copy's own parameter. `weight` is the copy, or the base while `enabled` is
    False (adapters_disabled: the KL reference). Every caller of lm_head.weight (the engine's logits, the
    learner's log-prob head, CUDA graphs) reads the live copy."""

    def __init__(self, base: nn.Module, tied: nn.Parameter | None = None):
        super().__init__()
        self.original_module = base
        if tied is None:
            self.modules_to_save = copy.deepcopy(base).requires_grad_(True)  # a new tensor, untied
        else:
            self.modules_to_save = nn.Module()
            self.modules_to_save.weight = tied
        if isinstance(base, nn.Linear):
            self.in_features, self.out_features = base.in_features, base.out_features
        self.enabled = True

    @property
    def weight(self) -> torch.Tensor:
        return self.modules_to_save.weight if self.enabled else self.original_module.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SavedEmbedding(SavedHead):
    """modules_to_save for the input embeddings (nn.Embedding): token ids [T] -> rows of `weight` [T, C]."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


@torch.no_grad()
def colocate(base: nn.Linear, adapter: LoraAdapter) -> None:
    """Put the adapter's A right behind the projection's frozen W in one allocation [W; A] (their values
    unchanged; W frozen and A trainable as before, each a view of it), so the engine computes x W^T and
    x A^T in one GEMM (LoraAdapter.project). No copy stays behind: W's and A's old storage is freed.
    Moving or sharding the parameters later (.to(), FSDP) separates them again; project() then
    runs the two GEMMs."""
    w, a = base.weight, adapter.lora_A
    if w.dtype != a.dtype or w.device != a.device or w.dim() != 2 or a.shape[1] != w.shape[1]:
        return
    joint = torch.empty(w.shape[0] + a.shape[0], w.shape[1], dtype=w.dtype, device=w.device)
    joint[:w.shape[0]].copy_(w)
    joint[w.shape[0]:].copy_(a)
    base.weight = nn.Parameter(joint[:w.shape[0]], requires_grad=w.requires_grad)
    adapter.lora_A = nn.Parameter(joint[w.shape[0]:], requires_grad=a.requires_grad)


def _owner(layer: nn.Module, proj: str) -> nn.Module:
    return getattr(layer, PROJECTIONS[proj][0])


def _slices(cfg: ModelConfig, proj: str) -> list[int]:
    if proj == "qkv_proj":
        return [cfg.num_attention_heads * cfg.head_dim] + [cfg.num_key_value_heads * cfg.head_dim] * 2
    if proj == "gate_up_proj":
        return [cfg.intermediate_size] * 2
    return [cfg.hidden_size]  # o_proj, down_proj


def add_lora(model: nn.Module, spec: LoraSpec, *, seed: int = 0) -> list[nn.Parameter]:
    """Attach adapters for spec.targets to every decoder layer of `model` (Qwen3ForCausalLM), in the
    model's dtype and device, PEFT-initialised from `seed`; freeze every base parameter. Returns the
    adapter parameters (the only trainable ones). ConfigError for MoE experts or a model with adapters."""
    cfg = model.config
    check_lora_fits(cfg, spec)
    if lora_spec(model) is not None:
        raise ConfigError("the model already has LoRA adapters")
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    dtype, device = model.dtype, model.device
    for layer in model.model.layers:
        for proj, (_, hf_names) in PROJECTIONS.items():
            targeted = [t in spec.targets for t in hf_names]
            if not any(targeted):
                continue
            base = getattr(_owner(layer, proj), proj)
            adapter = LoraAdapter(base.in_features, _slices(cfg, proj), targeted, spec)
            adapter.reset_parameters(gen)
            setattr(_owner(layer, proj), ADAPTER_ATTR[proj], adapter.to(device=device, dtype=dtype))
            if base.bias is None:
                colocate(base, adapter)
    if "embed_tokens" in spec.modules_to_save:
        model.model.embed_tokens = SavedEmbedding(model.model.embed_tokens)
    if spec.ties(cfg):  # ensure_weight_tying: the head reads the trained embeddings, as the base ties them
        model.lm_head = SavedHead(model.lm_head, tied=model.model.embed_tokens.modules_to_save.weight)
    elif "lm_head" in spec.modules_to_save:
        model.lm_head = SavedHead(model.lm_head)
    model.lora = spec  # a plain attribute: the spec the adapters were built from
    return lora_parameters(model)


def lora_spec(model: nn.Module) -> LoraSpec | None:
    """The LoraSpec of a model with adapters (add_lora), else None."""
    return getattr(model, "lora", None)


def adapters(model: nn.Module) -> list[LoraAdapter]:
    return [m for m in model.modules() if isinstance(m, LoraAdapter)]


def saved_modules(model: nn.Module) -> list[SavedHead]:
    return [m for m in model.modules() if isinstance(m, SavedHead)]


def unwrap_saved_head(model: nn.Module) -> None:
    """Make trained copies (SavedHead, SavedEmbedding) the model's plain modules, for a merged export; the
    config ties the embeddings only while the head and the embeddings are still one tensor."""
    if isinstance(model.model.embed_tokens, SavedEmbedding):
        model.model.embed_tokens = model.model.embed_tokens.modules_to_save
    if isinstance(model.lm_head, SavedHead):
        w = model.lm_head.modules_to_save.weight
        model.lm_head = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        model.lm_head.weight = w
    model.config.tie_word_embeddings = model.lm_head.weight is model.model.embed_tokens.weight


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters, in module order (A then B of each projection), then the trained copies
    (a tied copy once)."""
    return [p for a in adapters(model) for p in (a.lora_A, a.lora_B)] + \
        list(dict.fromkeys(m.modules_to_save.weight for m in saved_modules(model)))


def is_lora_parameter(name: str) -> bool:
    return name.endswith(".lora_A") or name.endswith(".lora_B") or ".modules_to_save." in name


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within the block the model computes as its base (every adapter off): the KL reference with no
    second copy of the weights; a SavedHead gives its base head. Restores each previous state on exit."""
    mods = adapters(model) + saved_modules(model)
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m, on in zip(mods, before):
            m.enabled = on


def lora_param_count(cfg: ModelConfig, spec: LoraSpec) -> int:
    """Trainable adapter parameters, as PEFT counts them (r * (C_in + C_out) per targeted projection
    per layer): the memory plan's count. The block-diagonal zeros of fused B (module docstring) add
    sum over fused projections of O * (n-1) * r stored zeros; lora_stored_count counts those."""
    per_layer = 0
    for proj, (_, hf_names) in PROJECTIONS.items():
        for t, out in zip(hf_names, _slices(cfg, proj)):
            if t in spec.targets:
                per_layer += spec.r * (_in_features(cfg, proj) + out)
    return per_layer * cfg.num_hidden_layers + _saved_count(cfg, spec)


def _saved_count(cfg: ModelConfig, spec: LoraSpec) -> int:
    """Elements of the trained full copies (modules_to_save): V * C each, one copy when tied."""
    return cfg.vocab_size * cfg.hidden_size * (1 if spec.ties(cfg) else len(spec.modules_to_save))


def lora_stored_count(cfg: ModelConfig, spec: LoraSpec) -> int:
    """Elements the adapters store (A and block-diagonal B), what the optimizer holds state for."""
    per_layer = 0
    for proj, (_, hf_names) in PROJECTIONS.items():
        n = sum(t in spec.targets for t in hf_names)
        if n:
            per_layer += n * spec.r * (_in_features(cfg, proj) + sum(_slices(cfg, proj)))
    return per_layer * cfg.num_hidden_layers + _saved_count(cfg, spec)


def _in_features(cfg: ModelConfig, proj: str) -> int:
    return {"qkv_proj": cfg.hidden_size, "o_proj": cfg.num_attention_heads * cfg.head_dim,
            "gate_up_proj": cfg.hidden_size, "down_proj": cfg.intermediate_size}[proj]


def lora_spec_of(section) -> LoraSpec | None:
    """The model.lora_* fields (a ModelSection, or anything with them) -> LoraSpec, None when lora_r is 0.
    Targets and modules_to_save: a list, or one string of comma-separated names."""
    if not section.lora_r:
        return None
    targets = section.lora_target_modules
    if isinstance(targets, str):
        targets = tuple(t.strip() for t in targets.split(",") if t.strip())
    saved = getattr(section, "lora_modules_to_save", ())
    if isinstance(saved, str):
        saved = tuple(t.strip() for t in saved.split(",") if t.strip())
    saved = tuple(saved or ())
    return LoraSpec(r=section.lora_r, alpha=float(section.lora_alpha), dropout=float(section.lora_dropout),
                    targets=targets, modules_to_save=saved, ensure_weight_tying="embed_tokens" in saved)
