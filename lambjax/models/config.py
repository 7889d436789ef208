"""BERT's configuration: its sizes, norms, dtypes, kernels, and the named presets.

`BertConfig` is validated once, on construction, with errors that name the bad field and
what would be valid; everything below reads it (lambjax.models.bert, .encoder, .params).
"""

import dataclasses

from lambjax import ranges
from lambjax.models import attention

PRESETS = {
    "tiny": dict(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=512),
    "mini": dict(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=1024),
    "base": dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072),
    "large": dict(num_layers=24, hidden_size=1024, num_heads=16, intermediate_size=4096),
}


# The model's sizes: positive integers, and with the architecture fields what its weights fix.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
)


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm: str = "post"  # "post" (original BERT) or "pre" (PreLN, as in PLD)
    layer_norm_eps: float = 1e-12
    # "layer_norm", or "none": the embeddings' and the encoder's LayerNorms keep only their
    # scale and bias (lambjax.models.standardization), for training with the
    # standardization loss (Collins et al. 2019) in their place.
    normalization: str = "layer_norm"
    initializer_range: float = 0.02
    dtype: str = "bfloat16"  # compute
    param_dtype: str = "float32"
    scan_layers: bool = True
    remat: bool = False  # recompute each layer's activations in the backward pass
    # "auto", "xla", "cudnn" or "splash": the attention kernel (lambjax.models.attention).
    attention: str = "auto"
    # GELU in the MLPs and the MLM head's transform: False = exact (erf), as BERT; True = the
    # tanh approximation (transformers' "gelu_new"), cheaper where erf is a long polynomial.
    gelu_approximate: bool = False

    def __post_init__(self):
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BertConfig.{name}={value!r} must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"BertConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}"
            )
        if self.layer_norm not in ("post", "pre"):
            raise ValueError(f"BertConfig.layer_norm={self.layer_norm!r}; valid: 'post', 'pre'")
        if self.normalization not in ("layer_norm", "none"):
            raise ValueError(
                f"BertConfig.normalization={self.normalization!r}; valid: 'layer_norm', 'none'"
            )
        if not isinstance(self.gelu_approximate, bool):
            raise ValueError(
                f"BertConfig.gelu_approximate={self.gelu_approximate!r}; valid: True (tanh), "
                "False (erf)"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"BertConfig.{name}={getattr(self, name)} must lie in [0, 1)")
        ranges.check("BertConfig.layer_norm_eps", self.layer_norm_eps, "(0, inf)")
        ranges.check("BertConfig.initializer_range", self.initializer_range, "[0, inf)")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(
                    f"BertConfig.{name}={getattr(self, name)!r}; valid: float32, bfloat16, float16"
                )
        try:
            attention.check(self.attention, self.attention_dropout, self.dtype, self.head_dim)
        except ValueError as e:
            raise ValueError(f"BertConfig.{e}") from None

    @classmethod
    def from_dict(cls, fields: dict) -> "BertConfig":
        """The config a checkpoint records (`dataclasses.asdict`). A `matmul_accumulation`
        field, which older checkpoints hold, is dropped: that emulation is a training
        method's setting, and the model it trained is a plain BERT."""
        return cls(**{k: v for k, v in fields.items() if k != "matmul_accumulation"})

    @classmethod
    def preset(cls, name: str, **overrides) -> "BertConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown BERT preset {name!r}; valid: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads
