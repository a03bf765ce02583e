"""The traced-graph cache (exporter/graph_cache.py): its key follows everything a trace reads, an
entry it cannot read is traced again, it stays under its size, and on the real SmolLM2 a build
from the cache equals a cold build byte for byte while a warm `check` still catches a tampered
engine. The rest of the suite runs with the cache off (tests/conftest.py), so no test reads an
entry another test's monkeypatched code wrote."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import onnx
import pytest
import torch
from onnx import helper

from adaptive_export.exporter import graph_cache as cache_module
from adaptive_export.exporter.graph_cache import GraphCache, cacheable, graph_cache, trace_key
from adaptive_export.graphs.span_graph import GraphSpec, ModelParts
from adaptive_export.loading.model import load_model
from tests.conftest import make_tiny_model, needs_smollm2

DECODE = GraphSpec("decode", "decode", (0, 1))


@pytest.fixture(scope="module")
def tiny_parts(tmp_path_factory: pytest.TempPathFactory) -> ModelParts:
    loaded = load_model(str(make_tiny_model(tmp_path_factory.mktemp("cache") / "tiny", "gqa_untied")))
    return ModelParts(loaded.hf_model, loaded.spec)


def test_the_key_changes_with_what_the_trace_reads(tiny_parts: ModelParts) -> None:
    key = trace_key(tiny_parts, DECODE, 64)
    assert key == trace_key(tiny_parts, DECODE, 64)  # deterministic
    assert key != trace_key(tiny_parts, replace(DECODE, logits="last"), 64)  # the GraphSpec
    assert key != trace_key(tiny_parts, DECODE, 128)  # the build's max_len
    norm = tiny_parts.hf_model.model.norm.weight
    saved = norm.detach().clone()
    with torch.no_grad():
        norm[0] = torch.nextafter(norm[0], torch.tensor(2.0))  # one ulp in a real (read) tensor
    try:
        assert key != trace_key(tiny_parts, DECODE, 64)
    finally:
        with torch.no_grad():
            norm.copy_(saved)
    assert key == trace_key(tiny_parts, DECODE, 64)


def test_graphs_with_trained_parts_are_never_cached() -> None:
    assert cacheable(DECODE)
    for trained in (
        replace(DECODE, router_scores=True),
        replace(DECODE, exit_adapter=True, exit_layer=1),
        replace(DECODE, skip_adapters=True),
        replace(DECODE, draft_vocab=8),
        DECODE.with_draft_field("guess_rows", 1),
    ):
        assert not cacheable(trained), trained


def tiny_model_proto(name: str) -> onnx.ModelProto:
    node = helper.make_node("Identity", ["x"], ["y"], name=name)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    return helper.make_model(helper.make_graph([node], "g", [x], [y]))


def test_an_entry_round_trips_and_an_unreadable_one_is_a_miss(tmp_path: Path) -> None:
    cache = GraphCache(tmp_path)
    assert cache.get("a" * 64) is None
    cache.put("a" * 64, tiny_model_proto("kept"))
    read = cache.get("a" * 64)
    assert read is not None and read.graph.node[0].name == "kept"
    (tmp_path / f"{'b' * 64}.onnx").write_bytes(b"\x08\xff\xff not a model")
    assert cache.get("b" * 64) is None
    assert not list(tmp_path.glob("*.partial"))  # written atomically


def test_the_oldest_entries_go_beyond_the_size_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = GraphCache(tmp_path)
    one = len(tiny_model_proto("n0").SerializeToString())
    monkeypatch.setattr(cache_module, "CACHE_BYTES", 2 * one + one // 2)
    for index in range(4):
        cache.put(f"{index:064d}", tiny_model_proto(f"n{index}"))
        os.utime(tmp_path / f"{index:064d}.onnx", (1000 + index, 1000 + index))
    cache.put("9" * 64, tiny_model_proto("n9"))
    assert sorted(p.stem[-1] for p in tmp_path.glob("*.onnx")) == ["3", "9"]


def test_the_setting_names_a_folder_or_turns_it_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ADAPTIVE_EXPORT_GRAPH_CACHE", "off")
    assert graph_cache() is None
    monkeypatch.setenv("ADAPTIVE_EXPORT_GRAPH_CACHE", str(tmp_path))
    assert graph_cache() == GraphCache(tmp_path)
    monkeypatch.delenv("ADAPTIVE_EXPORT_GRAPH_CACHE")
    monkeypatch.setenv("ADAPTIVE_EXPORT_CACHE", str(tmp_path / "home"))
    assert graph_cache() == GraphCache(tmp_path / "home" / "graphs")


@needs_smollm2
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_warm_cache_builds_the_same_bundle_and_check_still_catches_a_branch(
    smol_default_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import cli
    from tests.test_check_structure import branch_on_token, structure_results
    from tests.test_hardening import edit_engine, resign

    folder = tmp_path / "graphs"
    monkeypatch.setenv("ADAPTIVE_EXPORT_GRAPH_CACHE", str(folder))
    cold = cli("check", str(smol_default_bundle), "--model", "smollm2")  # traces, writes the entries
    assert cold.returncode == 0, cold.stderr
    entries = sorted(folder.glob("*.onnx"))
    assert entries, "the cold check wrote no entry"
    for entry in entries:
        os.utime(entry, (1, 1))

    warm = tmp_path / "warm"
    built = cli("build", "smollm2", "-o", str(warm), "--max-len", "256")
    assert built.returncode == 0, built.stderr
    assert all(entry.stat().st_mtime > 1 for entry in entries), "the build traced instead of reading the cache"
    for engine in sorted((smol_default_bundle / "onnx").iterdir()):
        assert (warm / "onnx" / engine.name).read_bytes() == engine.read_bytes(), engine.name

    tampered = tmp_path / "tampered"
    shutil.copytree(smol_default_bundle, tampered)
    edit_engine(tampered, "decode_full", branch_on_token)
    resign(tampered)
    report = tmp_path / "report.json"
    caught = cli("check", str(tampered), "--model", "smollm2", "--report", str(report))
    assert caught.returncode == 1, caught.stdout

    failed = [row for row in structure_results(json.loads(report.read_text())) if not row["passed"]]
    assert failed and all("differs from the model's" in row["detail"] for row in failed), failed
