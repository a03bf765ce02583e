"""A .gguf's weights as transformers loads them, one tensor at a time.

transformers' GGUF loader dequantizes every tensor of the file into fp32 before it builds the
model, then copies them in: 2x the fp32 model at its peak (12 GB for Qwen2.5-Coder-1.5B). The
memory-lean build (exporter/lean_export.py) needs the weights one at a time instead: this class
maps HF parameter names to GGUF tensors with transformers' own name map and tensor processor
(so a tensor equals what `from_pretrained(gguf_file=...)` puts in the model, llama's q/k row
order and Gemma's norm offset included) and dequantizes a tensor only when it is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from adaptive_export.loading.gguf_tensors import MappedGGUF, MappedTensor

FLOAT_VIEWS = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


class GGUFWeights:
    """HF parameter name -> the fp32 array transformers would load for it, read on demand."""

    def __init__(self, path: Path, hf_model: Any) -> None:
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self.path = path
        self.reader = MappedGGUF(path)
        self._tensors = {t.name: t for t in self.reader.tensors}
        architecture = str(self.reader.metadata.get("general.architecture", ""))
        config = hf_model.config
        processor_config = {
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
        }
        self._processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=processor_config)
        gguf_to_hf = get_gguf_hf_weights_map(hf_model, self._processor)
        self._gguf_name = {hf: gguf for gguf, hf in gguf_to_hf.items() if gguf in self._tensors}

    def gguf_name(self, hf_name: str) -> str:
        """The GGUF tensor that holds an HF parameter (KeyError if the file has none)."""
        return self._gguf_name[hf_name]

    def __contains__(self, hf_name: str) -> bool:
        return hf_name in self._gguf_name

    def array(self, hf_name: str) -> np.ndarray:
        """The parameter in fp32, HF's shape, as transformers' loader computes it."""
        import gguf

        name = self.gguf_name(hf_name)
        tensor = self._tensors[name]
        values = _dequantized(tensor, gguf)
        result = self._processor.process(weights=values, name=name, tensor_key_mapping={}, parsed_parameters={})
        array = np.array(result.weights, dtype=np.float32)  # a copy: the file's pages can go
        self.reader.release(name)
        return array

    def rows(self, hf_name: str, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of a 2-D parameter in fp32, only those rows dequantized (a trimmed head's rows
        of a 151,936-row table). For tensors transformers loads unchanged (embeddings, LM heads)."""
        import gguf

        name = self.gguf_name(hf_name)
        tensor = self._tensors[name]
        if len(tensor.shape) != 2:
            raise ValueError(f"tensor {name!r} is not a matrix")
        cols, count = (int(d) for d in tensor.shape)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= count):
            raise ValueError(f"row ids out of range for tensor {name!r} of {count} rows")
        kind = tensor.tensor_type.name
        if kind in FLOAT_VIEWS:
            picked = tensor.data.view(FLOAT_VIEWS[kind]).reshape(count, cols)[ids]
        elif kind == "BF16":
            picked = (tensor.data.view(np.uint16).reshape(count, cols)[ids].astype(np.uint32) << 16).view(np.float32)
        else:
            picked = gguf.quants.dequantize(tensor.data.reshape(count, -1)[ids], tensor.tensor_type)
        self.reader.release(name)
        return np.ascontiguousarray(picked, dtype=np.float32).reshape(len(ids), cols)


def _dequantized(tensor: MappedTensor, gguf: Any) -> np.ndarray:
    """One tensor's values, shaped in HF order (ggml lists the contiguous dimension first)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    kind = tensor.tensor_type.name
    if kind in FLOAT_VIEWS:
        return tensor.data.view(FLOAT_VIEWS[kind]).reshape(shape)
    if kind == "BF16":
        return (tensor.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    blocks = tensor.data.reshape(rows, -1)
    return gguf.quants.dequantize(blocks, tensor.tensor_type).reshape(shape)
