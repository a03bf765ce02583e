"""FiRST routers end to end on tiny models: training, configuration choice (superset rule),
engines per configuration against PyTorch, router scores, selection at prefill."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from adaptive_export.calibration.configs import choose_configs, layers_saved, served_share
from adaptive_export.commands.cli import main
from adaptive_export.exporter.check import engine_parity, greedy_check
from adaptive_export.loading.artifacts import load_parts
from adaptive_export.runtimes import Generator, load_bundle
from adaptive_export.runtimes.backends import make_backend
from adaptive_export.runtimes.manifest import ConfigEntry
from adaptive_export.runtimes.selection import choose_config
from tests.conftest import (
    ROUTER_CALIB as CALIB,
)  # router_setup (the routed tiny bundle) is a session fixture in conftest.py
from tests.conftest import make_tiny_model


def test_bundle_has_skip_configurations_and_calibration(router_setup: tuple[Path, Path, Path]) -> None:
    _, routed, _ = router_setup
    manifest = json.loads((routed / "manifest.json").read_text())
    skipping = [c for c in manifest["configs"] if len(c["kept"]) < manifest["model"]["num_layers"]]
    assert len(skipping) >= 1 and manifest["graphs"]["prefill"]["router_scores"]
    calibration = json.loads((routed / "calibration.json").read_text())
    shares = {c["id"]: c["share"] for c in calibration["configs"]["chosen"]}
    assert abs(sum(shares.values()) - 1.0) < 1e-6
    assert (
        calibration["routers"]["training"]["loss_last_epoch"] < calibration["routers"]["training"]["loss_first_epoch"]
    )


def test_every_engine_and_router_scores_match_pytorch(router_setup: tuple[Path, Path, Path]) -> None:
    model, routed, _ = router_setup
    bundle = load_bundle(routed)
    _, parts = load_parts(bundle, str(model))
    backend = make_backend(bundle, "onnx")
    for graph in bundle.manifest.graphs:  # the prefill check compares router_scores too
        result = engine_parity(bundle, backend, parts, graph)
        assert result.passed, result.detail
    generator = Generator(bundle)
    for config in bundle.manifest.configs:
        for prompt in CALIB[:3]:
            result = greedy_check(generator, parts, config, prompt, 16)
            assert result.passed, result.detail


def test_runtime_picks_config_by_superset_rule(router_setup: tuple[Path, Path, Path]) -> None:
    _, routed, _ = router_setup
    generator = Generator(routed)
    bundle = generator.bundle
    for prompt in CALIB:
        result = generator.generate(prompt, mode="ar", max_new_tokens=4)
        ids = generator.codec.encode(prompt)
        generator.arena.reset()
        scores = generator.backend.run("prefill", torch.tensor([ids]).numpy(), generator.arena, 0).router_scores
        kept = {i for i, s in enumerate(scores) if s >= bundle.manifest.router_threshold}
        config = bundle.config(result.stats.config)
        assert kept <= set(config.kept)
        assert result.stats.skipped_layers == bundle.num_layers - len(config.kept) and result.stats.kept_layers == list(
            config.kept
        )
        cheaper = [c for c in bundle.manifest.configs if kept <= set(c.kept) and len(c.kept) < len(config.kept)]
        assert not cheaper


def test_config_full_equals_bundle_without_routers(router_setup: tuple[Path, Path, Path]) -> None:
    _, routed, plain = router_setup
    with_routers, without = Generator(routed), Generator(plain)
    for prompt in CALIB:
        assert (
            with_routers.generate(prompt, mode="ar", max_new_tokens=16, config="full").tokens
            == without.generate(prompt, mode="ar", max_new_tokens=16).tokens
        )


def test_superset_choice_on_handmade_histograms() -> None:
    full = frozenset(range(6))
    hist = Counter({frozenset({0, 1, 2}): 5, frozenset({0, 1, 3}): 3, frozenset({0, 1, 2, 3, 4}): 2})
    one = choose_configs(hist, 6, 1)
    assert one == [frozenset({0, 1, 2, 3})]  # serves 8 prompts at 2 skipped = 16 > {0,1,2}: 5 x 3 = 15
    two = choose_configs(hist, 6, 2)  # greedy alone would keep {0,1,2,3} and save only 21
    assert set(two) == {frozenset({0, 1, 2}), frozenset({0, 1, 3})}
    assert layers_saved(hist, two, 6) == 5 * 3 + 3 * 3
    shares = served_share(hist, two, 6)
    assert shares[full] == pytest.approx(0.2) and abs(sum(shares.values()) - 1) < 1e-9
    # under a quality floor: the best passing candidate replaces a failing one
    assert choose_configs(hist, 6, 1, acceptable=lambda kept: kept != frozenset({0, 1, 2, 3})) == [frozenset({0, 1, 2})]
    restored = choose_configs(Counter({frozenset({0, 1, 2}): 5}), 6, 1, acceptable=lambda kept: len(kept) >= 4)
    assert (
        len(restored) == 1 and len(restored[0]) == 4 and frozenset({0, 1, 2}) < restored[0]
    )  # one skipped layer kept again
    assert choose_configs(hist, 6, 2, acceptable=lambda kept: False) == []
    configs = [
        ConfigEntry("full", tuple(range(6)), {"decode": "decode_full"}),
        ConfigEntry("a", (0, 1, 2), {"decode": "decode_a"}),
        ConfigEntry("b", (0, 1, 2, 3, 4), {"decode": "decode_b"}),
    ]
    assert choose_config(configs, [0, 2]).id == "a"
    assert choose_config(configs, [0, 3]).id == "b"
    assert choose_config(configs, [5]).id == "full"


def test_training_reacts_to_lambda(router_setup: tuple[Path, Path, Path]) -> None:
    from adaptive_export.calibration.greedy import greedy_sequence
    from adaptive_export.calibration.routers import TrainingSequence, train_routers
    from adaptive_export.loading.model import load_model

    model, _, _ = router_setup
    loaded = load_model(str(model))
    sequences = [TrainingSequence(*greedy_sequence(loaded, p, 8)) for p in CALIB]
    low = train_routers(loaded, sequences, lam=0.0, lr=0.02, progress=False)
    high = train_routers(loaded, sequences, lam=3.0, lr=0.02, progress=False)
    assert high.mean_p_last < low.mean_p_last


def test_routers_file_with_wrong_shape_is_rejected(
    router_setup: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    model, _, _ = router_setup
    bad = tmp_path / "bad.safetensors"
    save_file({"weight": torch.zeros(3, 5)}, str(bad))
    assert main(["build", str(model), "-o", str(tmp_path / "o"), "--routers", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "holds weight of shape (3, 5), this model needs (6, 64)" in err and "Fix:" in err


def test_routers_file_round_trip(router_setup: tuple[Path, Path, Path], tmp_path: Path) -> None:
    model, routed, _ = router_setup
    assert (
        main(
            [
                "build",
                str(model),
                "-o",
                str(tmp_path / "again"),
                "--max-len",
                "96",
                "--routers",
                str(routed / "routers.safetensors"),
                "--calib",
                str(routed.parent / "calib.jsonl"),
                "--min-config-agreement",
                "0",
            ]
        )
        == 0
    )
    first = json.loads((routed / "manifest.json").read_text())["configs"]
    second = json.loads((tmp_path / "again" / "manifest.json").read_text())["configs"]
    assert [c["kept"] for c in first] == [c["kept"] for c in second]


def test_configurations_below_the_quality_floor_get_no_engine(
    router_setup: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    from adaptive_export.calibration.router_pipeline import RouterOptions, plan_routers
    from adaptive_export.loading.model import load_model

    model, routed, _ = router_setup
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CALIB))
    loaded = load_model(str(model))
    results = {}
    for floor in (0.0, 1.01):  # nothing is dropped / everything is (agreement cannot exceed 1)
        options = RouterOptions(
            routers="train",
            calib=str(calib),
            router_lambda=2.0,
            router_lr=0.02,
            seed=0,
            max_configs=3,
            min_config_agreement=floor,
        )
        planned = plan_routers(options, loaded)
        configs, report = planned.configs, planned.report
        results[floor] = (configs, report["configs"]["quality"])
    kept_all, quality_all = results[0.0]
    assert (
        kept_all
        and not quality_all["dropped"]
        and all(0.0 <= row["agreement"] <= 1.0 for row in quality_all["measured"])
    )
    none, quality_none = results[1.01]
    assert none == [] and quality_none["dropped"] and len(quality_none["dropped"]) == len(quality_none["measured"])


def test_training_does_not_depend_on_the_size_of_activations(tmp_path: Path) -> None:
    """Scaling the embeddings and every residual write (o_proj, down_proj) by 30 multiplies
    every layer's input by 30 and leaves the model's logits unchanged (each sublayer reads
    an RMS-normalised input). Router training must then reach the same decisions: trained on
    raw inputs, Adam moved a router's logit in proportion to its layer's activations, so
    on SmolLM2 the routers skipped the last two layers (large activations, the costliest
    to skip) first."""
    from transformers import AutoModelForCausalLM

    from adaptive_export.calibration.greedy import greedy_sequence
    from adaptive_export.calibration.routers import TrainingSequence, router_scores, train_routers
    from adaptive_export.loading.model import load_model

    directory = make_tiny_model(tmp_path / "model", "gqa_untied", layers=6)
    scaled_dir = tmp_path / "scaled"
    hf = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(30.0)
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(30.0)
            layer.mlp.down_proj.weight.mul_(30.0)
    hf.save_pretrained(scaled_dir)
    for source in directory.iterdir():  # the tokenizer and its chat template
        if not (scaled_dir / source.name).exists():
            (scaled_dir / source.name).write_bytes(source.read_bytes())
    scores = []
    first_sequences = None
    for path in (directory, scaled_dir):
        loaded = load_model(str(path))
        sequences = [TrainingSequence(*greedy_sequence(loaded, p, 8)) for p in CALIB]
        routers = train_routers(loaded, sequences, lam=0.3, lr=0.02, progress=False).routers
        scores.append(torch.tensor([router_scores(loaded, routers, seq.ids[: seq.prompt_len]) for seq in sequences]))
        if len(scores) == 2:
            assert sequences == first_sequences  # same greedy continuations: the model is unchanged
        first_sequences = sequences
    assert torch.allclose(scores[0], scores[1], atol=1e-3), (scores[0] - scores[1]).abs().max()


def test_inspect_lists_configurations_with_their_layers(
    router_setup: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, routed, _ = router_setup
    assert main(["inspect", str(routed)]) == 0
    text = capsys.readouterr().out
    for config in json.loads((routed / "manifest.json").read_text())["configs"]:
        skipped = sorted(set(range(6)) - set(config["kept"]))
        assert f"{config['id']:10} keeps {len(config['kept'])} layers, skips {len(skipped)}" in text
        if skipped:
            shorter = f"skipped: {skipped}" if len(skipped) <= len(config["kept"]) else f"kept: {config['kept']}"
            assert shorter in text
