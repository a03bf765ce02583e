"""FiRST's LoRA compensation (`build --routers train --lora R`) on a tiny model: the shared skip
adapters train, the configurations they help are compiled with them, every engine matches
PyTorch with the adapters in place, `run --json` and `inspect` say so, and a changed adapter
fails `check`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from adaptive_export.calibration.router_pipeline import THRESHOLDS
from adaptive_export.calibration.routers import GatedModel, TrainingSequence, continuation_agreement
from adaptive_export.calibration.skip_adapters import adapted_agreement, as_module_dict, train_skip_adapters
from adaptive_export.commands.cli import main
from adaptive_export.graphs.span_graph import GraphSpec, SpanGraph
from adaptive_export.loading.artifacts import SKIP_ADAPTERS_FILE, load_parts
from adaptive_export.runtimes import Generator, load_bundle
from tests.conftest import ROUTER_CALIB, make_tiny_model
from tests.test_hardening import resign

PROMPTS = ROUTER_CALIB * 2  # 12: three of every four train the adapters, the fourth measures the floor


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(root / "model", "gqa_untied", layers=6)
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    argv = ["build", str(model), "-o", str(root / "b"), "--max-len", "96", "--routers", "train"]
    argv += ["--calib", str(calib), "--router-lambda", "2.0", "--router-lr", "0.02", "--quality-floor", "0"]
    assert main([*argv, "--lora", "4"]) == 0
    return model, root / "b"


def adapted_configs(bundle: Path) -> list[dict]:
    manifest = json.loads((bundle / "manifest.json").read_text())
    return [c for c in manifest["configs"] if manifest["graphs"][c["engines"]["decode"]].get("skip_adapters")]


def test_adapters_raise_the_agreement_they_trained_for(tmp_path: Path) -> None:
    """Trained on a skip set, the adapters keep more of the full model's greedy tokens on their
    training text than the same skip set without them (the identity they start from)."""
    from adaptive_export.calibration.greedy import greedy_sequences
    from adaptive_export.loading.model import load_model

    loaded = load_model(str(make_tiny_model(tmp_path / "m", "gqa_untied", layers=6)))
    sequences = [TrainingSequence(*s) for s in greedy_sequences(loaded, PROMPTS[:6], 16, progress=False)]
    model = GatedModel(loaded).eval().requires_grad_(False)
    kept = frozenset({0, 2, 5})
    training = train_skip_adapters(model, sequences, [kept], rank=4, epochs=4, progress=False)
    before = continuation_agreement(model, sequences, kept)
    after = adapted_agreement(model, sequences, kept, as_module_dict(training.adapters))
    assert after > before
    assert training.steps == 4 * len(sequences) and training.kept_sets == 1


def test_a_helped_configuration_is_compiled_with_its_adapters(lora_setup: tuple[Path, Path]) -> None:
    _, bundle = lora_setup
    assert adapted_configs(bundle), "no configuration kept more with the adapters"
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert SKIP_ADAPTERS_FILE in manifest["files"] and not manifest["graphs"]["decode_full"]["skip_adapters"]
    calibration = json.loads((bundle / "calibration.json").read_text())
    assert manifest["router_threshold"] == calibration["routers"]["threshold"]  # --lora calibrates it
    sweep = calibration["routers"]["threshold_sweep"]
    assert [row["threshold"] for row in sweep] == list(THRESHOLDS)
    assert all(row["layers_saved_per_prompt"] >= row["layers_saved_per_prompt_without_adapters"] for row in sweep)
    quality = calibration["configs"]["quality"]
    adapters = quality["skip_adapters"]
    assert adapters["rank"] == 4 and adapters["steps"] > 0
    by_rule = adapters["layers_saved_per_prompt_by_rule"]  # both sets of kept sets trained, the better kept
    assert set(by_rule) == {"lowest threshold", "within reach"}
    assert by_rule[adapters["kept_sets_rule"]] == max(by_rule.values())
    for config in adapted_configs(bundle):
        row = next(r for r in quality["measured"] if r["kept"] == config["kept"])
        assert row["with_adapters"] > row["without_adapters"] and row["agreement"] == row["with_adapters"]


def test_the_adapted_engine_runs_the_adapters(lora_setup: tuple[Path, Path]) -> None:
    """The engine matches the PyTorch graph with the adapters (check's parity), and that graph
    differs from the same configuration without them: the adapters are in the engine."""
    model, bundle = lora_setup
    _, parts = load_parts(load_bundle(bundle), str(model))
    kept = tuple(adapted_configs(bundle)[0]["kept"])
    n, spec = len(kept), parts.spec
    past = [torch.randn(5, spec.num_kv_heads, spec.head_dim)] * (2 * n)
    ids = torch.tensor([[7]])
    with torch.no_grad():
        adapted = SpanGraph(parts, GraphSpec("d", "decode", kept, skip_adapters=True)).eval()(ids, *past)[0]
        plain = SpanGraph(parts, GraphSpec("d", "decode", kept)).eval()(ids, *past)[0]
    assert not torch.allclose(adapted, plain, atol=1e-3)
    report = bundle.parent / "check.json"
    assert main(["check", str(bundle), "--model", str(model), "--report", str(report), "--new-tokens", "8"]) == 0
    rows = json.loads(report.read_text())["results"]
    adapted_engine = adapted_configs(bundle)[0]["engines"]["decode"]
    assert any(r["engine"] == adapted_engine and r["check"] == "parity" and r["passed"] for r in rows)


def test_an_adapted_configuration_drafts_and_verifies_with_its_adapters(tmp_path: Path) -> None:
    """Early exit in an adapted configuration: its draft and verify graphs adapt their layers too,
    so draft (kept layers below E) then verify (the rest, from the draft's hidden state) computes
    exactly the configuration's adapted decode, and the exactness of speculation holds."""
    from adaptive_export.graphs.adaptive import ExitAdapter
    from adaptive_export.graphs.drafts.early_exit import ExitPlan, exit_graphs
    from adaptive_export.graphs.plan import SkipConfig
    from adaptive_export.graphs.span_graph import ModelParts
    from adaptive_export.loading.model import load_model

    loaded = load_model(str(make_tiny_model(tmp_path / "m", "gqa_untied", layers=6)))
    spec = loaded.spec
    torch.manual_seed(0)
    adapters = {i: ExitAdapter(spec.hidden_size, 4, spec.rms_norm_eps) for i in range(spec.num_layers)}
    for adapter in adapters.values():
        torch.nn.init.normal_(adapter.up.weight, std=0.5)  # trained adapters are not the identity
    parts = ModelParts(loaded.hf_model, spec, skip_adapters=adapters)
    config = SkipConfig("s1", (0, 2, 3, 5), adapters=True)
    draft, verify = exit_graphs(config, ExitPlan(exit_layer=3, draft_len=2))
    assert draft.skip_adapters and verify.skip_adapters
    empty = torch.zeros(0, spec.num_kv_heads, spec.head_dim)
    ids = torch.tensor([[5, 9, 11]])
    with torch.no_grad():
        decode = SpanGraph(parts, GraphSpec("d", "decode", config.kept, skip_adapters=True)).eval()
        expected = decode(ids, *[empty] * 8)[0]
        hidden = SpanGraph(parts, draft).eval()(ids, *[empty] * 4)[1]
        got = SpanGraph(parts, verify).eval()(hidden, *[empty] * 4)[0]
        unadapted = SpanGraph(parts, GraphSpec("d", "decode", config.kept)).eval()(ids, *[empty] * 8)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unadapted, expected, atol=1e-3)


def test_run_and_inspect_report_the_adapters(lora_setup: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    _, bundle = lora_setup
    adapted_ids = {c["id"] for c in adapted_configs(bundle)}
    generator = Generator(bundle)
    seen = {}
    for prompt in ROUTER_CALIB:
        stats = generator.generate(prompt, mode="ar", max_new_tokens=2).stats
        seen[stats.config] = stats.skip_adapters
    assert seen and all(adapted == (config in adapted_ids) for config, adapted in seen.items())
    assert main(["inspect", str(bundle)]) == 0
    assert "skip adapters" in capsys.readouterr().out


def test_a_changed_adapter_fails_check(lora_setup: tuple[Path, Path], tmp_path: Path) -> None:
    """The adapters are the bundle's own (no model defines them): a re-signed bundle whose
    adapter file no longer holds what its engines compute fails check's parity."""
    from safetensors.torch import load_file, save_file

    model, bundle = lora_setup
    tampered = tmp_path / "tampered"
    shutil.copytree(bundle, tampered)
    tensors = load_file(str(tampered / SKIP_ADAPTERS_FILE))
    key = next(k for k in sorted(tensors) if k.endswith("up.weight"))
    tensors[key] = tensors[key] + 0.5
    save_file(tensors, str(tampered / SKIP_ADAPTERS_FILE))
    resign(tampered)
    report = tmp_path / "r.json"
    assert main(["check", str(tampered), "--model", str(model), "--report", str(report), "--new-tokens", "4"]) == 1
    failed = {r["engine"] for r in json.loads(report.read_text())["results"] if not r["passed"]}
    assert {c["engines"]["decode"] for c in adapted_configs(bundle)} & failed


def test_an_adapted_graph_without_its_adapters_is_one_line(
    lora_setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A re-signed bundle that no longer lists its adapter file: check says so (exit 2), not a traceback."""
    model, bundle = lora_setup
    bad = tmp_path / "bad"
    shutil.copytree(bundle, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    del manifest["files"][SKIP_ADAPTERS_FILE]
    resign(bad, manifest)
    assert main(["check", str(bad), "--model", str(model), "--new-tokens", "2"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: graph 'decode_s") and "holds no adapter" in last and "unexpected" not in last


def test_lora_needs_routers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = make_tiny_model(tmp_path / "m", "gqa_untied", layers=2)
    assert main(["build", str(model), "-o", str(tmp_path / "b"), "--lora", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --lora 4 calibrates skip configurations") and "Fix: add --routers" in err[-1]
    assert not (tmp_path / "b").exists()


def test_the_manifest_refuses_adapters_on_the_full_model(lora_setup: tuple[Path, Path], tmp_path: Path) -> None:
    _, bundle = lora_setup
    bad = tmp_path / "bad"
    shutil.copytree(bundle, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["graphs"]["decode_full"]["skip_adapters"] = True
    resign(bad, manifest)
    with pytest.raises(Exception, match="adapts skipped layers"):
        load_bundle(bad)


def test_the_threshold_sweep_skips_the_most_the_floor_allows() -> None:
    """`--router-threshold auto`: a higher cut skips more layers per prompt; the sweep keeps the
    threshold whose passing configurations save the most, the lowest on a tie."""
    from adaptive_export.calibration.router_pipeline import RouterOptions, sweep_thresholds

    layers = 4
    # per prompt the router scores of 4 layers; layer 3 is scored low by every prompt, layer 2 by half
    scores = [[0.95, 0.95, 0.65, 0.55]] * 2 + [[0.95, 0.95, 0.95, 0.55]] * 2

    class AtMostOneSkipped:  # the quality floor: a set passes if it skips at most one layer
        def passes(self, kept: frozenset[int]) -> bool:
            return len(kept) >= layers - 1

    options = RouterOptions(routers="train", router_threshold="auto", max_configs=2)
    threshold, histogram, chosen, sweep = sweep_thresholds(options, scores, layers, AtMostOneSkipped())
    saved = {row["threshold"]: row["layers_saved_per_prompt"] for row in sweep}
    assert saved == {t: (0.0 if t <= 0.55 else 1.0) for t in THRESHOLDS}  # 0.55 >= 0.55 keeps layer 3
    assert threshold == 0.6 and chosen == [frozenset({0, 1, 2})]
    assert histogram == {frozenset({0, 1, 2}): 4}
    fixed = RouterOptions(routers="train", router_threshold="0.5", max_configs=2)
    assert sweep_thresholds(fixed, scores, layers, AtMostOneSkipped())[0] == 0.5


def test_the_floor_measures_at_most_its_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A high threshold offers hundreds of candidate sets; past MAX_MEASUREMENTS a set is refused
    without its minutes of measuring, and the report counts it."""
    from adaptive_export.calibration import router_pipeline
    from adaptive_export.loading.model import load_model

    monkeypatch.setattr(router_pipeline, "MAX_MEASUREMENTS", 2)
    loaded = load_model(str(make_tiny_model(tmp_path / "m", "gqa_untied", layers=4)))
    sequences = [TrainingSequence([3, 5, 7, 9, 11, 13], 3)]
    quality = router_pipeline.QualityFloor(loaded, sequences, floor=0.0)
    assert quality.passes(frozenset({0, 1, 2})) and quality.passes(frozenset({0, 1}))
    assert not quality.passes(frozenset({0}))  # floor 0 passes any measured set: this one went unmeasured
    assert quality.passes(frozenset({0, 1}))  # measured sets still answer
    report = quality.report()
    assert len(report["measured"]) == 2 and report["refused_unmeasured"] == 1


def test_adapters_train_on_the_sets_within_their_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapters train on the routers' kept sets at any threshold tried that keep at least
    floor - ADAPTER_REACH unaided: not a set far below the floor, not the full model, and only
    the ADAPTER_SETS most frequent ones (each measured once)."""
    from types import SimpleNamespace

    from adaptive_export.calibration import router_pipeline

    # at 0.6 and 0.7 the first rows keep {0, 1, 2} or {0, 1}, the fourth {0, 2, 3}, the fifth {0, 1, 2}
    scores = [[0.95, 0.95, 0.65, 0.57]] * 3 + [[0.95, 0.58, 0.95, 0.95], [0.95, 0.95, 0.95, 0.57], [0.95] * 4]
    unaided = {frozenset({0, 1, 2}): 0.9, frozenset({0, 1}): 0.7, frozenset({0, 2, 3}): 0.5}
    measured: list[frozenset[int]] = []

    class Floor:
        floor = 0.8
        model = SimpleNamespace(spec=SimpleNamespace(num_layers=4))

        def unaided(self, kept: frozenset[int]) -> float:
            measured.append(kept)
            return unaided[kept]

    thresholds = (0.5, 0.6, 0.7)
    sets = router_pipeline.adapter_sets(scores, thresholds, Floor())  # type: ignore[arg-type]
    assert sets == [frozenset({0, 1}), frozenset({0, 1, 2})]  # {0, 2, 3} keeps 0.5 < 0.8 - 0.15
    assert sorted(measured, key=sorted) == sorted(unaided, key=sorted)
    monkeypatch.setattr(router_pipeline, "ADAPTER_SETS", 1)  # the most frequent: {0, 1, 2}, 5 times
    assert router_pipeline.adapter_sets(scores, thresholds, Floor()) == [frozenset({0, 1, 2})]  # type: ignore[arg-type]
