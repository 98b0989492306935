"""Per-device bytes of a training run's state: the M_weights term of docs/METHOD.md's B_KV for RL.

In rlengine the generator decodes from the learner's parameters, so what occupies the device
before any KV block is the TRAINING state, not just the weights. Per parameter (bytes):

    | precision                         | weights | master | Adam m, v | grads            | total |
    |-----------------------------------|---------|--------|-----------|------------------|-------|
    | fp32 (no masters)                 | 4       | 0      | 8         | 4                | 16    |
    | bf16/fp16 + fp32 masters (default)| 2       | 4      | 8         | 4 fp32 (+2 bf16) | 20    |
    | bf16/fp16 without masters         | 2       | 0      | 4 (bf16)  | 2                | 8     |

The bf16 gradient of one micro-batch lives only until it is added into the fp32 master grad
(rlengine/rl/algo/optim.py), but it is counted: it is there at the activation peak. Inference alone
(LLM without a learner) needs the weights column only. Activations and the KV cache are separate
terms of the memory plan (B_KV = floor((alpha*C_mem - M_weights - M_runtime) / m_KV(S))).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlengine.analysis.roofline import param_counts
from rlengine.model.config import ModelConfig

_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainStateBytes:
    """Bytes per parameter of each part of the training state, and their sum."""

    weights: int
    master: int
    moments: int
    grads: int

    @property
    def total(self) -> int:
        return self.weights + self.master + self.moments + self.grads


def training_bytes_per_param(dtype: str, master_weights: str = "auto") -> TrainStateBytes:
    """The table above for a compute dtype ('float32' | 'bfloat16' | 'float16') and train.master_weights."""
    if dtype not in _BYTES:
        raise ValueError(f"dtype must be one of {', '.join(_BYTES)}, got {dtype!r}")
    if master_weights not in ("auto", "fp32", "none"):
        raise ValueError(f"master_weights must be auto|fp32|none, got {master_weights!r}")
    w = _BYTES[dtype]
    masters = master_weights == "fp32" or (master_weights == "auto" and w < 4)
    if masters:
        return TrainStateBytes(weights=w, master=4, moments=8, grads=4 + (w if w < 4 else 0))
    return TrainStateBytes(weights=w, master=0, moments=2 * w, grads=w)


def reference_device_params(cfg: ModelConfig, *, offload: bool = False) -> int:
    """Parameters of the frozen KL reference that sit on the device: all of them, or with offload
    (train.ref_offload: decoder layers on the host, streamed one at a time) the embedding, the LM
    head, the final norm and the largest single decoder layer."""
    p = param_counts(cfg)
    if not offload:
        return p.total
    L, C = cfg.num_hidden_layers, cfg.hidden_size
    dense_mlp = 3 * C * cfg.intermediate_size
    moe_mlp = (p.router // p.moe_layers + p.num_experts * p.expert) if p.moe_layers else 0
    mlp = max(moe_mlp, dense_mlp if p.moe_layers < L else 0)
    layer = p.attention // L + 2 * C + mlp
    return p.embedding + (0 if p.tied else p.lm_head) + C + layer


def training_state_bytes(cfg: ModelConfig, dtype: str, master_weights: str = "auto", *,
                         critic: bool = False, kl_reference: bool = False, ref_offload: bool = False,
                         lora_params: int = 0) -> int:
    """M_weights of a training run on one device: the policy's training state, plus a PPO critic
    (a trunk copy with its own optimizer state: the LM head excluded) and a frozen KL reference
    (weights only; with ref_offload only its device-resident part, reference_device_params).
    lora_params > 0 (LoRA, model/lora.py lora_stored_count): the base is frozen (its weights only) and
    the adapters carry the training state; the KL reference is the base with the adapters off (0 bytes)."""
    n = param_counts(cfg).total
    per = training_bytes_per_param(dtype, master_weights).total
    total = n * per if not lora_params else n * _BYTES[dtype] + lora_params * per
    if lora_params:
        kl_reference = False
    if critic:
        counts = param_counts(cfg)
        trunk = n - (0 if counts.tied else counts.lm_head)
        total += trunk * per
    if kl_reference:
        total += reference_device_params(cfg, offload=ref_offload) * _BYTES[dtype]
    return total
