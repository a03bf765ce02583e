"""Each fused op's eager PyTorch code (graphs/ort_ops.py, the reference `check` uses) against
the ONNX Runtime contrib kernel it is exported to, one node at a time."""

from __future__ import annotations

import numpy as np
import pytest

HEADS, KV_HEADS, HEAD_DIM, MAX_LEN = 4, 1, 16, 64


def _gqa_node_session(local_window_size: int, scale: float):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    packed = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    inputs = [
        ("qkv", TensorProto.FLOAT, [1, "T", packed]),
        ("past_key", TensorProto.FLOAT, [1, KV_HEADS, MAX_LEN, HEAD_DIM]),
        ("past_value", TensorProto.FLOAT, [1, KV_HEADS, MAX_LEN, HEAD_DIM]),
        ("seqlens_k", TensorProto.INT32, [1]),
        ("total", TensorProto.INT32, []),
        ("cos", TensorProto.FLOAT, [MAX_LEN, HEAD_DIM // 2]),
        ("sin", TensorProto.FLOAT, [MAX_LEN, HEAD_DIM // 2]),
    ]
    # the attributes exporter/ort_translations.py gives the node: rotary inside, not interleaved
    attributes = {"num_heads": HEADS, "kv_num_heads": KV_HEADS, "scale": scale, "do_rotary": 1, "rotary_interleaved": 0}
    node = helper.make_node(
        "GroupQueryAttention",
        ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"],
        ["out", "present_key", "present_value"],
        domain="com.microsoft",
        local_window_size=local_window_size,
        **attributes,
    )
    graph = helper.make_graph(
        [node],
        "gqa",
        [helper.make_tensor_value_info(*i) for i in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "present_key", "present_value")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("local_window_size", [-1, 5])
@pytest.mark.parametrize("new, past", [(20, 0), (1, 30), (4, 30)])  # prefill, decode, verify past the window
def test_gqa_matches_group_query_attention(new: int, past: int, local_window_size: int) -> None:
    """The window counts the query's own key (HF's sliding window W is local_window_size W):
    an off-by-one here would shift every sliding layer's attention by a key."""
    import torch

    from adaptive_export.graphs import ort_ops

    rng = np.random.default_rng(new + past)
    qkv = rng.standard_normal((1, new, (HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    past_key, past_value = (np.zeros((1, KV_HEADS, MAX_LEN, HEAD_DIM), np.float32) for _ in range(2))
    past_key[:, :, :past] = rng.standard_normal((1, KV_HEADS, past, HEAD_DIM))
    past_value[:, :, :past] = rng.standard_normal((1, KV_HEADS, past, HEAD_DIM))
    cos, sin = (rng.standard_normal((MAX_LEN, HEAD_DIM // 2)).astype(np.float32) for _ in range(2))
    scale = 24**-0.5
    feeds = dict(
        qkv=qkv,
        past_key=past_key,
        past_value=past_value,
        seqlens_k=np.array([past + new - 1], np.int32),
        total=np.array(past + new, np.int32),
        cos=cos,
        sin=sin,
    )
    theirs = _gqa_node_session(local_window_size, scale).run(None, feeds)
    ours = ort_ops.gqa(
        *(torch.from_numpy(feeds[k]) for k in ("qkv", "past_key", "past_value", "seqlens_k", "total", "cos", "sin")),
        HEADS,
        KV_HEADS,
        scale,
        local_window_size,
    )
    for got, want in zip(ours, theirs):
        np.testing.assert_allclose(got.numpy(), want, atol=2e-5, rtol=1e-5)
    if local_window_size > 0:  # the window changed the result, so the comparison above tested it
        unwindowed = ort_ops.gqa(
            *(
                torch.from_numpy(feeds[k])
                for k in ("qkv", "past_key", "past_value", "seqlens_k", "total", "cos", "sin")
            ),
            HEADS,
            KV_HEADS,
            scale,
            -1,
        )[0].numpy()
        assert np.abs(unwindowed - theirs[0]).max() > 1e-2


def test_gelu_tanh_matches_fast_gelu() -> None:
    """FastGelu is GELU's tanh approximation, the function HF's gelu_pytorch_tanh computes."""
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper

    from adaptive_export.graphs import ort_ops

    node = helper.make_node("FastGelu", ["x"], ["y"], domain="com.microsoft")
    graph = helper.make_graph(
        [node],
        "gelu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    x = (np.random.default_rng(0).standard_normal((1, 3, 512)) * 4).astype(np.float32)
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    ours = ort_ops.gelu_tanh(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    assert np.abs(ours - torch.nn.functional.gelu(torch.from_numpy(x)).numpy()).max() > 1e-5  # not the erf GELU
