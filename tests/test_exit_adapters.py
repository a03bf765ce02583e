"""Exit adapters on tiny models: fitting raises early-exit agreement, the draft engine computes
head(adapter(h_E)) like PyTorch, speculation through it stays lossless, bad files are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from adaptive_export.commands.cli import main
from adaptive_export.exporter.check import engine_parity
from adaptive_export.loading.artifacts import ADAPTERS_FILE, load_parts
from adaptive_export.runtimes import Generator, load_bundle
from adaptive_export.runtimes.backends import make_backend
from adaptive_export.runtimes.errors import UsageError
from tests.conftest import build_tiny, tiny6_model
from tests.test_speculative import PROMPTS, assert_same_or_tie

CALIB = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Write a short poem about the sea and the sky.",
    "Static graphs make edge compilers happy.",
    "the sea and the stars",
    "Paris is the capital of France.",
]


@pytest.fixture(scope="module")
def adapter_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    flags = ["--max-len", "128", "--speculate", "auto", "--exit-adapter", "fit"]
    return tiny6_model(tmp_path_factory), build_tiny(tmp_path_factory, *flags, calib=CALIB)


def test_fitting_raises_train_agreement(adapter_setup: tuple[Path, Path]) -> None:
    from adaptive_export.calibration.exit_adapters import fit_exit_adapters
    from adaptive_export.loading.model import load_model

    loaded = load_model(str(adapter_setup[0]))
    fit = fit_exit_adapters(loaded, CALIB, [2, 4], rank=16, epochs=4, new_tokens=12, progress=False)
    for e in ("2", "4"):
        row = fit.report["per_exit"][e]
        assert row["train"]["after"] >= row["train"]["before"] + 0.05, row
        assert row["params"] == 64 + 2 * 16 * 64
    assert fit.report["held_out_prompts"] == 1 and fit.report["positions"]["held_out"] > 0


def test_bundle_ships_the_chosen_adapter(adapter_setup: tuple[Path, Path]) -> None:
    bundle = load_bundle(adapter_setup[1])
    spec = bundle.manifest.speculation.to_json()
    assert spec["adapter"] is True and (bundle.root / ADAPTERS_FILE).is_file()
    draft = next(g for g in bundle.manifest.graphs.values() if g.kind == "draft")
    assert draft.exit_adapter and draft.exit_layer == spec["exit_layer"]
    calibration = json.loads((bundle.root / "calibration.json").read_text())["speculation"]
    assert calibration["early_exit_through_adapter"] and calibration["exit_adapters"]["shipped"] == spec["exit_layer"]
    assert set(calibration["exit_adapters"]["per_exit"]) == {"3", "4", "5"}
    assert (
        sorted(int(k.split(":")[0]) for k in calibration["early_exit_tokens_per_round"])[0] == 3
    )  # only the adapters' exits


def test_draft_engine_matches_pytorch_head_of_adapter(adapter_setup: tuple[Path, Path]) -> None:
    bundle = load_bundle(adapter_setup[1])
    loaded, parts = load_parts(bundle, str(adapter_setup[0]))
    e = bundle.manifest.speculation.extra["exit_layer"]
    adapter = parts.exit_adapters[e]
    assert float(adapter.up.weight.detach().abs().max()) > 0  # fitted, not the identity
    backend = make_backend(bundle, "onnx")
    for name in bundle.manifest.graphs:
        result = engine_parity(bundle, backend, parts, name)
        assert result.passed, (name, result.detail)
    # independent of SpanGraph: HF hidden_states[E] -> adapter -> final norm + LM head
    from adaptive_export.graphs.layers import Head

    generator = Generator(bundle)
    draft_name = bundle.config("full").engines["draft"]
    ids = generator.codec.encode("Write a short poem about the sea", raw=True)
    generator.arena.reset()
    generator.backend.run("prefill", np.asarray([ids[:-1]]), generator.arena, 0)
    generator.arena.length = len(ids) - 1
    out = generator.backend.run(draft_name, np.asarray([ids[-1:]]), generator.arena, len(ids) - 1)
    with torch.no_grad():
        h = loaded.hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[e][0, -1:]
        head = Head(loaded.hf_model, loaded.spec)
        expected, raw = head(adapter(h)).numpy(), head(h).numpy()
    np.testing.assert_allclose(out.logits[0], expected, atol=1e-3, rtol=1e-4)
    assert np.abs(expected - raw).max() > 1e-2  # the engine really applies the adapter


def test_greedy_speculation_through_adapter_equals_plain_decoding(adapter_setup: tuple[Path, Path]) -> None:
    generator = Generator(adapter_setup[1])
    drafted = 0
    for prompt in PROMPTS:
        ids = generator.codec.encode(prompt, raw=True)
        ar = generator.generate(ids, mode="ar", max_new_tokens=32).tokens
        result = generator.generate(ids, max_new_tokens=32, mode="spec", draft="early_exit", draft_len=3)
        assert result.stats.speculation["draft_source"] == "early_exit"
        drafted += result.stats.speculation["drafted"]
        assert_same_or_tie(generator, ids, ar, result.tokens)
    assert drafted > 0


def test_adapter_file_round_trip(adapter_setup: tuple[Path, Path]) -> None:
    """--speculate E:k --exit-adapter FILE ships the same adapter (planning only: the export is tested above)."""
    from adaptive_export.calibration.speculation import SpeculationOptions, plan_speculation
    from adaptive_export.graphs.span_graph import ModelParts
    from adaptive_export.loading.model import load_model

    model, bundle = adapter_setup
    e = json.loads((bundle / "manifest.json").read_text())["speculation"]["exit_layer"]
    loaded = load_model(str(model))
    parts = ModelParts(loaded.hf_model, loaded.spec)
    adapter_file = str(bundle / ADAPTERS_FILE)
    plan, manifest, _, files = plan_speculation(SpeculationOptions(f"{e}:2", exit_adapter=adapter_file), loaded, parts)
    assert plan.adapter and manifest["adapter"] and set(parts.exit_adapters) == {e}
    assert files[ADAPTERS_FILE] == (bundle / ADAPTERS_FILE).read_bytes()
    with pytest.raises(UsageError, match="has no adapter for exit layer"):
        plan_speculation(SpeculationOptions(f"{6 - e if e != 3 else 2}:2", exit_adapter=adapter_file), loaded, parts)


def test_adapter_file_with_wrong_shapes_is_rejected(
    adapter_setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    bad = tmp_path / "bad.safetensors"
    save_file(
        {"3.norm_weight": torch.ones(5), "3.down.weight": torch.zeros(4, 5), "3.up.weight": torch.zeros(5, 4)}, str(bad)
    )
    assert (
        main(
            [
                "build",
                str(adapter_setup[0]),
                "-o",
                str(tmp_path / "o"),
                "--speculate",
                "3:2",
                "--exit-adapter",
                str(bad),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]  # earlier lines: the model loader's progress bars
    assert err.startswith("error: exit adapter file") and "Fix:" in err
    assert "down.weight (rank, 64)" in err and not (tmp_path / "o").exists()


def test_missing_adapter_file_or_no_speculation_fails_fast(
    adapter_setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(adapter_setup[0])
    assert (
        main(
            [
                "build",
                model,
                "-o",
                str(tmp_path / "o"),
                "--speculate",
                "3:2",
                "--exit-adapter",
                str(tmp_path / "nope.safetensors"),
            ]
        )
        == 2
    )
    assert "does not exist" in capsys.readouterr().err
    assert main(["build", model, "-o", str(tmp_path / "o"), "--exit-adapter", "fit"]) == 2
    assert "needs --speculate" in capsys.readouterr().err


def test_gated_exit_block_file_round_trips(tmp_path: Path) -> None:
    """A trained draft head's gated block (build --draft-head) ships as exit_adapters.safetensors;
    `check` and `--exit-adapter FILE` read it back as the same block."""
    from adaptive_export.graphs.adaptive import GatedExitAdapter
    from adaptive_export.loading.artifacts import adapters_bytes, load_adapters

    torch.manual_seed(0)
    block = GatedExitAdapter(64, 48, 1e-6)
    torch.nn.init.normal_(block.down.weight, std=0.05)
    path = tmp_path / ADAPTERS_FILE
    path.write_bytes(adapters_bytes({3: block}))
    loaded = load_adapters(path, 64, 1e-6, 6)
    assert isinstance(loaded[3], GatedExitAdapter)
    x = torch.randn(5, 64)
    torch.testing.assert_close(loaded[3](x), block(x))
    assert not torch.equal(block(x), x)  # the block is not the identity, so the comparison means something
