"""Portable graphs written from short traces (exporter/repeated_layers.py) and the name-free
comparison check makes of them (exporter/check_structure.py's _Wiring): on tiny models of each
uniform architecture and on the real SmolLM2, the written graph is the whole trace up to value
names (its weights by name and content); traces that do not repeat are refused; and the
comparison still tells a rewired node, an extra node and a value defined twice from a rename."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from adaptive_export.exporter.build import flavoured
from adaptive_export.exporter.check_structure import _interface, _nodes
from adaptive_export.exporter.lean_export import export_lean_graph, fake_names, repeated_lean_graph
from adaptive_export.exporter.repeated_layers import NotRepeating, write_layers
from adaptive_export.graphs.plan import BuildPlan
from adaptive_export.graphs.span_graph import GraphSpec, ModelParts
from adaptive_export.loading.model import load_model
from tests.conftest import make_tiny_model, needs_smollm2


def lean_parts(directory: Path) -> tuple[ModelParts, dict[int, str]]:
    """A tiny model as check's rebuild traces a .gguf (loading/lean_model.py): large tensors fake,
    small ones real (a tiny model's are all below SMALL_PARAMETER: here, what onnx_ir's
    initializer deduplication reads)."""
    import torch

    from adaptive_export.loading.lean_model import fake_model

    real = load_model(str(directory))
    hf_model = fake_model(real.hf_model.config)
    generator = torch.Generator().manual_seed(0)
    for name, parameter in real.hf_model.named_parameters():
        if parameter.numel() <= 1024:  # what onnx_ir's deduplication reads; norms made unequal, as trained
            value = parameter.detach() + 0.1 * torch.rand(parameter.shape, generator=generator)  # ones are
            owner, _, leaf = name.rpartition(".")
            setattr(hf_model.get_submodule(owner), leaf, torch.nn.Parameter(value, requires_grad=False))
    parts = ModelParts(hf_model, real.spec)
    return parts, fake_names(parts, None)


def portable_graphs(parts: ModelParts) -> list[GraphSpec]:
    return flavoured(BuildPlan(num_layers=parts.spec.num_layers).graphs(), "portable")


def weights(model: onnx.ModelProto, names: set[str]) -> dict[str, bytes]:
    return {t.name: t.SerializeToString() for t in model.graph.initializer if t.name in names}


def assert_written_equals_traced(parts: ModelParts, graph: GraphSpec, names: dict[int, str]) -> None:
    written = repeated_lean_graph(parts, graph, None, names)
    assert written is not None, f"{graph.name} of {parts.spec.model_type} did not repeat"
    traced = export_lean_graph(parts, graph, None, names)
    assert len(written.graph.node) == len(traced.graph.node)
    assert _nodes(written, traced) is None and _interface(written, traced) is None
    model_tensors = set(names.values()) | {n for n, _ in parts.hf_model.named_parameters()}
    model_tensors |= {t.name for t in traced.graph.initializer if "layers." in t.name or "norm" in t.name}
    assert weights(written, model_tensors) == weights(traced, model_tensors)


@pytest.mark.parametrize("variant", ["gqa_untied", "qwen2_gqa"])
def test_a_tiny_stack_is_written_as_its_whole_trace(variant: str, tmp_path: Path) -> None:
    parts, names = lean_parts(make_tiny_model(tmp_path / variant, variant, layers=6))
    for graph in portable_graphs(parts):
        assert_written_equals_traced(parts, graph, names)


def test_graphs_with_trained_parts_a_partial_or_a_short_stack_are_traced_whole(tmp_path: Path) -> None:
    parts, names = lean_parts(make_tiny_model(tmp_path / "tiny", layers=6))
    decode = portable_graphs(parts)[-1]
    assert repeated_lean_graph(parts, replace(decode, router_scores=True), None, names) is None
    assert repeated_lean_graph(parts, replace(decode, layers=(0, 1, 2, 4, 5)), None, names) is None
    assert repeated_lean_graph(parts, replace(decode, flavour="ort"), None, names) is None
    short, short_names = lean_parts(make_tiny_model(tmp_path / "short", layers=3))
    assert repeated_lean_graph(short, portable_graphs(short)[-1], None, short_names) is None  # shorter than a trace


def test_traces_whose_blocks_differ_are_refused(tmp_path: Path) -> None:
    """A node changed in the large trace's last block: no decomposition, so no written graph."""
    parts, names = lean_parts(make_tiny_model(tmp_path / "tiny", layers=6))
    decode = portable_graphs(parts)[-1]
    small, large = (export_lean_graph(parts, replace(decode, layers=tuple(range(n))), None, names) for n in (2, 4))
    adds = [node for node in large.graph.node if node.op_type == "Add"]
    adds[-2].op_type = "Sub"  # in the last layer's block
    model_names = set(names.values()) | {t.name for t in large.graph.initializer if "layers." in t.name}
    with pytest.raises(NotRepeating):
        write_layers(small, large, 6, model_names.__contains__, lambda name, template: template)
    adds[-2].op_type = "Add"
    assert len(write_layers(small, large, 6, model_names.__contains__, lambda name, template: template).graph.node)


@needs_smollm2
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.heavy
def test_smollm2_graphs_are_written_as_their_whole_traces() -> None:
    """The real 30-layer stack, over fake weights as check's rebuild traces it."""
    from adaptive_export.loading.lean_model import load_lean_model

    lean = load_lean_model("smollm2")
    parts = ModelParts(lean.hf_model, lean.spec)
    names = fake_names(parts, None)
    for graph in portable_graphs(parts):
        assert_written_equals_traced(parts, graph, names)


@needs_smollm2
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.heavy
def test_smollm2_cold_portable_check_passes_and_a_tamper_is_reported_from_whole_traces(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The user's path, graph cache off: a portable bundle passes `check --model` on written graphs;
    a token branch in its decode engine fails it, the node named as whole traces name it."""
    import shutil

    from tests.conftest import build_smollm2
    from tests.test_check_structure import branch_on_token, check_in_child, structure_results
    from tests.test_hardening import edit_engine, resign

    bundle = build_smollm2(tmp_path_factory, "portable", "--onnx-flavour", "portable", "--max-len", "256")
    code, report, seconds, peak = check_in_child(bundle, tmp_path)
    rows = {r["engine"]: r for r in structure_results(report)}
    assert code == 0 and set(rows) == {"prefill", "decode_full", "configs"}, report
    assert all(r["passed"] for r in rows.values()) and "equal to" in rows["decode_full"]["detail"], report
    assert seconds < 300 and peak < 4 << 30, (seconds, peak)  # 40 s and 1.7 GB on Zen 4; whole traces 81 s

    tampered = tmp_path / "tampered"
    shutil.copytree(bundle, tampered)
    edit_engine(tampered, "decode_full", branch_on_token)
    resign(tampered)
    code, report, _, _ = check_in_child(tampered, tmp_path)
    failed = [r for r in structure_results(report) if not r["passed"]]
    assert code == 1 and [r["engine"] for r in failed] == ["decode_full"], report
    assert failed[0]["detail"].startswith("node ") and "differs from the model's" in failed[0]["detail"]


def small_model(rename: bool = False) -> onnx.ModelProto:
    """y = (x + c) * x, with its intermediate value named `s` or `renamed`."""
    middle = "renamed" if rename else "s"
    nodes = [helper.make_node("Add", ["x", "c"], [middle]), helper.make_node("Mul", [middle, "x"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [helper.make_tensor("c" if not rename else "c_other_name", TensorProto.FLOAT, [2], [1.0, 2.0])],
    )
    if rename:
        graph.node[0].input[1] = "c_other_name"
    return helper.make_model(graph)


def test_the_comparison_ignores_names_and_sees_wiring() -> None:
    model = small_model()
    assert _nodes(small_model(rename=True), model) is None  # a value and a constant renamed: the same graph

    rewired = small_model()
    rewired.graph.node[1].input[1] = "c"  # (x + c) * c
    assert _nodes(rewired, model) == "node 1 (Mul '') differs from the model's (Mul '')"

    other_constant = small_model()
    other_constant.graph.initializer[0].CopyFrom(helper.make_tensor("c", TensorProto.FLOAT, [2], [1.0, 3.0]))
    assert _nodes(other_constant, model) == "node 0 (Add '') differs from the model's (Add '')"

    twice = small_model()
    twice.graph.node[0].output[0] = "c"  # shadows the constant
    twice.graph.node[1].input[0] = "c"
    assert _nodes(twice, model) == "value 'c' is defined more than once"

    extra = small_model()
    extra.graph.node.append(helper.make_node("Neg", ["y"], ["z"]))
    assert _nodes(extra, model) == "3 nodes where the model defines 2; the first extra is Neg ''"


def test_an_engine_with_its_own_local_functions_is_refused_before_any_comparison() -> None:
    """A local function could give an op another body: the bundle's graph policy refuses such an
    engine when it is read (runtimes/graph_policy.py), so check never compares one."""
    from adaptive_export.runtimes.errors import UsageError
    from adaptive_export.runtimes.graph_policy import _parse

    bad = small_model()
    body = helper.make_function("evil", "Add", ["a", "b"], ["c"], [helper.make_node("Sub", ["a", "b"], ["c"])], [])
    bad.functions.append(body)
    _parse(small_model().SerializeToString(), "engine")
    with pytest.raises(UsageError, match="model-local functions"):
        _parse(bad.SerializeToString(), "engine")
