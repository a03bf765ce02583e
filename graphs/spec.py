"""Model dimensions shared by the exporter, the bundle manifest and the runtime.

The runtime reads these back from manifest.json, so this module stays free of torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    """The dimensions that fix every static shape of the exported graphs."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelSpec:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})
