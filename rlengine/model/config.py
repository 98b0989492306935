"""Model configuration: one dataclass for Qwen3 (dense, MoE), Qwen2 / Qwen2.5 and Llama 3.x, plus presets.

ModelConfig mirrors the Hugging Face config.json fields that change the computation and
nothing else. The three families share one decoder; `model_type` switches what differs: Qwen3 has
per-head q/k RMSNorm, Qwen2 has q/k/v biases, Llama 3 has neither (and may use the llama3 RoPE
rule). Features the decoder does not implement (sliding windows, biases on Llama, other RoPE
kinds) are rejected with a ConfigError rather than run with different numerics. `from_hf_dict` /
`to_hf_dict` are the only places that know HF's key names (including the renames between
transformers 4.x and 5.x). Presets are plain factories; the tiny ones run a forward on the CPU in
milliseconds and are what the tests and the embedded default job use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

# dtype names accepted on the command line and in configs
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}  # float64: a test-only dtype (exact multi-rank equivalence)

ARCH_DENSE = "Qwen3ForCausalLM"
ARCH_MOE = "Qwen3MoeForCausalLM"
# HF model_type -> architecture; MoE is Qwen3 only (ModelConfig.model_type "qwen3" with num_experts > 0)
HF_ARCHS = {"qwen3": ARCH_DENSE, "qwen3_moe": ARCH_MOE, "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
SUPPORTED_ARCHS = tuple(HF_ARCHS.values())
MODEL_TYPES = ("qwen3", "qwen2", "llama")  # the dense families of ModelConfig.model_type
ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ConfigError(ValueError):
    """A configuration value is missing or outside its allowed range."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(slots=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a Qwen3 / Qwen3-MoE / Qwen2 / Llama decoder. MoE iff num_experts > 0 (Qwen3 only)."""

    vocab_size: int
    hidden_size: int                      # C
    intermediate_size: int                # F of the dense MLP layers
    num_hidden_layers: int                # L
    num_attention_heads: int              # H
    num_key_value_heads: int              # Hkv; H % Hkv == 0
    head_dim: int                         # D (may differ from C / H in Qwen3 and Llama)
    model_type: str = "qwen3"             # family: qwen3 (q/k norm), qwen2 (q/k/v bias), llama (neither)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None      # HF rope_parameters minus rope_theta (linear or llama3); None = default
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False          # q/k/v projection biases (always on in Qwen2, never in Llama)
    # MoE (Qwen3-MoE). num_experts == 0 means every layer is dense.
    num_experts: int = 0                  # E
    num_experts_per_tok: int = 0          # K (top-k)
    moe_intermediate_size: int = 0        # F of one expert
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, f"ModelConfig.{name} must be an int >= 1, got {value!r}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                 f"num_key_value_heads ({self.num_key_value_heads})")
        _require(self.head_dim % 2 == 0, f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        _require(self.rms_norm_eps > 0, f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, f"ModelConfig.rope_theta must be > 0, got {self.rope_theta}")
        _require(self.model_type in MODEL_TYPES,
                 f"ModelConfig.model_type must be one of {', '.join(MODEL_TYPES)}, got {self.model_type!r}")
        if self.model_type == "qwen2":
            _require(self.attention_bias, "ModelConfig.attention_bias must be True for model_type 'qwen2' "
                                          "(Qwen2 always has q/k/v biases)")
        if self.model_type == "llama":
            _require(not self.attention_bias, "ModelConfig.attention_bias must be False for model_type 'llama' "
                                              "(attention biases are not supported for Llama)")
        _require(not self.num_experts or self.model_type == "qwen3",
                 f"ModelConfig.num_experts must be 0 for model_type {self.model_type!r} (MoE is Qwen3-MoE only)")
        self._check_rope_scaling()
        if self.num_experts:
            _require(1 <= self.num_experts_per_tok <= self.num_experts,
                     f"ModelConfig.num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                     f"got {self.num_experts_per_tok}")
            _require(self.moe_intermediate_size >= 1,
                     f"ModelConfig.moe_intermediate_size must be >= 1 for MoE, got {self.moe_intermediate_size}")
            _require(self.decoder_sparse_step >= 1,
                     f"ModelConfig.decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        _require(not bad, f"ModelConfig.mlp_only_layers has layer ids outside [0, {self.num_hidden_layers}): {bad}")

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling is None:
            return
        kind = self.rope_type
        _require(kind in ROPE_TYPES, f"ModelConfig.rope_scaling rope_type {kind!r} is not supported "
                                     f"(supported: {', '.join(ROPE_TYPES)})")
        factor = self.rope_scaling.get("factor", 1.0)
        _require(isinstance(factor, (int, float)) and factor > 0,
                 f"ModelConfig.rope_scaling factor must be a number > 0, got {factor!r}")
        if kind == "llama3":
            missing = [k for k in LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
            _require(not missing, f"ModelConfig.rope_scaling of rope_type 'llama3' is missing {', '.join(missing)}")
            low, high = self.rope_scaling["low_freq_factor"], self.rope_scaling["high_freq_factor"]
            _require(0 < low < high, f"ModelConfig.rope_scaling needs 0 < low_freq_factor < high_freq_factor, "
                                     f"got {low!r} and {high!r}")
            orig = self.rope_scaling["original_max_position_embeddings"]
            _require(isinstance(orig, int) and orig >= 1,
                     f"ModelConfig.rope_scaling original_max_position_embeddings must be an int >= 1, got {orig!r}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k before RoPE (Qwen3 and Qwen3-MoE only)."""
        return self.model_type == "qwen3"

    @property
    def rope_type(self) -> str:
        """default, linear or llama3 (the HF rope_type)."""
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))

    @property
    def hf_model_type(self) -> str:
        return "qwen3_moe" if self.is_moe else self.model_type

    @property
    def architecture(self) -> str:
        return HF_ARCHS[self.hf_model_type]

    def is_moe_layer(self, layer_id: int) -> bool:
        """Qwen3-MoE rule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
        return (self.is_moe and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json ------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        """Build from a HF config dict; `source` names the file in error messages."""
        hf_type = _hf_model_type(d, source)
        is_moe = hf_type == "qwen3_moe"
        _reject_unsupported(d, hf_type, source)
        required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
        required += ["moe_intermediate_size", "num_experts_per_tok"] if is_moe else ["intermediate_size"]
        missing = [k for k in required if k not in d]
        if is_moe and "num_experts" not in d and "num_local_experts" not in d:
            missing.append("num_experts")
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        # transformers 5 writes rope_parameters (with rope_theta inside), 4.x rope_scaling + rope_theta
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10_000.0))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        heads = d["num_attention_heads"]
        kw = dict(
            model_type="qwen3" if is_moe else hf_type,
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", d.get("moe_intermediate_size")),
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=rope or None,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            # Qwen2 has no attention_bias field: its q/k/v projections always have biases
            attention_bias=True if hf_type == "qwen2" else d.get("attention_bias", False),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )
        if is_moe:
            kw.update(num_experts=d.get("num_experts", d.get("num_local_experts")),
                      num_experts_per_tok=d["num_experts_per_tok"],
                      moe_intermediate_size=d["moe_intermediate_size"],
                      norm_topk_prob=d.get("norm_topk_prob", False),
                      decoder_sparse_step=d.get("decoder_sparse_step", 1),
                      mlp_only_layers=list(d.get("mlp_only_layers") or []))
        try:
            return cls(**kw)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def to_hf_dict(self) -> dict:
        """A config.json dict that transformers (4.51+ and 5.x) loads as this family's model."""
        rope = {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})}
        d = {
            "architectures": [self.architecture],
            "model_type": self.hf_model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_parameters": rope,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu", "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "torch_dtype": "float32",
        }
        if self.model_type == "qwen2":
            d.update(use_sliding_window=False, sliding_window=None,
                     layer_types=["full_attention"] * self.num_hidden_layers)
        else:
            d["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            d["mlp_bias"] = False
        if self.is_moe:
            d.update(num_experts=self.num_experts, num_local_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers))
        return d


def _hf_model_type(d: dict, source: str) -> str:
    """The HF model_type of a config dict (from model_type, else architectures[0]), checked against both."""
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if model_type is None:
        by_arch = {arch: t for t, arch in HF_ARCHS.items()}
        if not archs or archs[0] not in by_arch:
            raise ConfigError(f"{source}: unsupported architecture {archs[0] if archs else None!r}; "
                              f"rlengine supports {', '.join(SUPPORTED_ARCHS)}")
        return by_arch[archs[0]]
    if model_type not in HF_ARCHS:
        raise ConfigError(f"{source}: unsupported model_type {model_type!r}; rlengine supports model_type "
                          f"{', '.join(HF_ARCHS)}")
    if archs and archs[0] != HF_ARCHS[model_type]:
        raise ConfigError(f"{source}: unsupported architecture {archs[0]!r} for model_type {model_type!r} "
                          f"(expected {HF_ARCHS[model_type]})")
    return model_type


def _reject_unsupported(d: dict, hf_type: str, source: str) -> None:
    """Features whose numerics the shared decoder does not implement: an error, never a silent difference."""
    if d.get("use_sliding_window"):
        raise ConfigError(f"{source}: use_sliding_window=true is not supported (only full attention)")
    layer_types = [t for t in d.get("layer_types") or [] if t != "full_attention"]
    if layer_types:
        raise ConfigError(f"{source}: layer_types {sorted(set(layer_types))} are not supported (only full_attention)")
    if hf_type == "llama":
        for name in ("attention_bias", "mlp_bias"):
            if d.get(name):
                raise ConfigError(f"{source}: {name}=true is not supported for Llama (no projection biases)")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {d['hidden_act']!r} is not supported (only silu)")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor {partial!r} is not supported (only 1.0)")


# ---- presets ---------------------------------------------------------------------------
def _tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                rope_theta=10_000.0, tie_word_embeddings=True,
                # ids of the built-in tokenizer's specials (rlengine.model.tokenizer)
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return ModelConfig(**base)


PRESETS = {
    # Tests and the embedded default job.
    "tiny": lambda: _tiny(),
    "tiny-moe": lambda: _tiny(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True),
    "tiny-qwen2": lambda: _tiny(model_type="qwen2", attention_bias=True),
    "tiny-llama": lambda: _tiny(model_type="llama", rope_theta=500_000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    # ~30M parameters: the CPU decode benchmark shape.
    "qwen3-30m": lambda: ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536,
                                     num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                     head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Real model shapes (random weights unless loaded from a checkpoint): roofline and benches.
    "qwen3-0.6b": lambda: ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                      num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True),
    "qwen3-30b-a3b": lambda: ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                         num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                         head_dim=128, max_position_embeddings=40960, num_experts=128,
                                         num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    "llama-3-8b": lambda: ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096,
                                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                                      rope_theta=500_000.0, tie_word_embeddings=False,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192},
                                      bos_token_id=128000, eos_token_id=128001),
}


def preset(name: str) -> ModelConfig:
    """A named ModelConfig; raises ConfigError listing the known names."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]()
