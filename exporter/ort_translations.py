"""ONNX translations of graphs/ort_ops.py for the ONNX Runtime flavour: fused contrib ops.

Handed to `torch.onnx.export(custom_translation_table=...)`; the attribute names and input
order follow ONNX Runtime's contrib op schemas (docs/ContribOperators.md in onnxruntime).
"""

from __future__ import annotations

from typing import Any

import onnxscript
import torch
from onnxscript import FLOAT, INT32
from onnxscript.values import Opset

import adaptive_export.graphs.ort_ops  # noqa: F401  (registers the custom ops)

_MSFT = Opset("com.microsoft", 1)
_ONNX = Opset("", 18)


def _rms_norm(x: FLOAT, weight: FLOAT, eps: float) -> FLOAT:
    return _ONNX.SimplifiedLayerNormalization(x, weight, axis=-1, epsilon=eps, stash_type=1)


def _skip_rms_norm(x: FLOAT, skip: FLOAT, weight: FLOAT, eps: float) -> tuple[FLOAT, FLOAT]:
    normed, _mean, _inv_std, total = _MSFT.SkipSimplifiedLayerNormalization(x, skip, weight, epsilon=eps)
    return normed, total


def _gelu_tanh(x: FLOAT) -> FLOAT:
    return _MSFT.FastGelu(x)


def _gqa(
    qkv: FLOAT,
    past_key: FLOAT,
    past_value: FLOAT,
    seqlens_k: INT32,
    total_length: INT32,
    cos_cache: FLOAT,
    sin_cache: FLOAT,
    num_heads: int,
    kv_heads: int,
    scale: float,
    local_window_size: int,
) -> tuple[FLOAT, FLOAT, FLOAT]:
    out, present_key, present_value = _MSFT.GroupQueryAttention(
        qkv,
        None,
        None,
        past_key,
        past_value,
        seqlens_k,
        total_length,
        cos_cache,
        sin_cache,
        num_heads=num_heads,
        kv_num_heads=kv_heads,
        scale=scale,
        do_rotary=1,
        rotary_interleaved=0,
        local_window_size=local_window_size,
    )
    return out, present_key, present_value


def translation_table() -> dict[Any, Any]:
    return {
        torch.ops.adaptive_export.rms_norm.default: onnxscript.script(opset=_ONNX, default_opset=_ONNX)(_rms_norm),
        torch.ops.adaptive_export.skip_rms_norm.default: onnxscript.script(opset=_ONNX, default_opset=_ONNX)(
            _skip_rms_norm
        ),
        torch.ops.adaptive_export.gqa.default: onnxscript.script(opset=_ONNX, default_opset=_ONNX)(_gqa),
        torch.ops.adaptive_export.gelu_tanh.default: onnxscript.script(opset=_ONNX, default_opset=_ONNX)(_gelu_tanh),
    }
