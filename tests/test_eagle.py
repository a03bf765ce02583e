"""The EAGLE head (`build --eagle-head N`, runtimes/drafting/eagle.py): the decode graph's in-graph
guesses equal PyTorch's (`check` parity), drafting with them never changes plain decoding's tokens,
the floor round of two-row decoding drafts with them, and a bad option or a hostile manifest is one
error line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from adaptive_export.commands.cli import main
from tests.conftest import build_tiny, needs_smollm2

EAGLE_FLAGS = ("--max-len", "128", "--eagle-head", "64")
PROMPTS = ("def add(a, b):", "Write a haiku about autumn leaves.", "The capital of France is")


@pytest.fixture(scope="module")
def eagle_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a head trained on a smaller text than the real recipe's (the suite's time)."""
    from adaptive_export.calibration.drafts import eagle

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eagle, "REQUESTS", 16)
        patch.setattr(eagle, "DOCSTRINGS", 60)
        return build_tiny(tmp_path_factory, *EAGLE_FLAGS)


def run_json(bundle: Path, prompt: str, capsys: pytest.CaptureFixture[str], *flags: str) -> dict:
    capsys.readouterr()
    assert main(["run", str(bundle), "-p", prompt, "--max-new-tokens", "40", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_head_ships_in_the_decode_graph_and_its_guesses_pass_check(
    eagle_bundle: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The full decode graph guesses (field `eagle` = the head's width, output `guesses`), the head's
    table and vocabulary ship beside it, and `check` finds every guess equal to PyTorch's head on
    the same inputs, and the eagle drafts greedy-identical."""
    from tests.conftest import tiny6_model

    manifest = json.loads((eagle_bundle / "manifest.json").read_text())
    decode = manifest["graphs"]["decode_full"]
    assert decode["eagle"] == 2 * 64 and "guesses" in decode["outputs"]  # the tiny model's hidden size is 64
    # prefill carries the head too, so the fused prefill and decode graphs stay one engine file (one session)
    assert manifest["graphs"]["prefill"]["eagle"] == 2 * 64 and "guesses" in manifest["graphs"]["prefill"]["outputs"]
    onnx_graphs = manifest["backends"]["onnx"]["graphs"]
    assert onnx_graphs["prefill"]["file"] == onnx_graphs["decode_full"]["file"]
    assert manifest["configs"][0]["engines"]["eagle"] == "decode_full"
    assert manifest["draft_vocab"]["size"] == 64 and "eagle_head.safetensors" in manifest["files"]
    assert 0.0 <= manifest["speculation"]["eagle"]["acceptance"] <= 1.0
    report = tmp_path / "report.json"
    model = tiny6_model(tmp_path_factory)
    assert main(["check", str(eagle_bundle), "--model", str(model), "--report", str(report)]) == 0
    results = json.loads(report.read_text())["results"]
    parity = next(r for r in results if r["engine"] == "decode_full" and r["check"] == "parity")
    assert parity["passed"] and "guesses" not in parity["detail"]
    assert any(r["engine"] == "spec:full:eagle" and r["passed"] for r in results)


def test_guesses_are_compared_token_for_token() -> None:
    """`check` fails an engine whose guesses differ from the reference's on an fp32 engine."""
    from adaptive_export.exporter.check import compare_outputs

    same = np.array([[5, 7, 9]]), np.array([[5, 7, 9]])
    other = np.array([[5, 8, 9]]), np.array([[5, 7, 9]])
    assert not compare_outputs(["guesses"], [same], False, 1.0).failures
    failures = compare_outputs(["guesses"], [other], False, 1.0).failures
    assert failures == ("guesses: 67% of rows guess the reference's token",)
    assert not compare_outputs(["guesses"], [other], True, 1.0).failures  # quantized: informational


@pytest.mark.parametrize("prompt", PROMPTS)
def test_eagle_drafts_keep_plain_tokens(eagle_bundle: Path, prompt: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--draft eagle` drafts one guess a round from the last pass and keeps `--mode ar`'s tokens (one
    row and two); its rounds draft after every round that emitted a token the head guessed after."""
    plain = run_json(eagle_bundle, prompt, capsys, "--mode", "ar")["tokens"]
    eagle = run_json(eagle_bundle, prompt, capsys, "--mode", "spec", "--draft", "eagle")
    two_rows = run_json(eagle_bundle, prompt, capsys, "--mode", "ar", "--decode-rows", "2")
    assert eagle["tokens"] == plain and two_rows["tokens"] == plain
    rounds = eagle["stats"]
    assert rounds["draft_source"] == "eagle" and rounds["draft_len"] == 1
    # every round drafts but the first (prefill guesses nothing) and one whose budget leaves only the bonus token
    assert rounds["drafted"] >= rounds["rounds"] - 2
    assert rounds["accepted"] <= rounds["drafted"]


def test_the_floor_round_guesses_with_the_head() -> None:
    """A floor round's guess: prompt lookup's when the context repeats, else the last pass's in-graph
    guess for this very position, else `pending`."""
    from adaptive_export.runtimes.drafting import PLAIN, RoundOutcome
    from adaptive_export.runtimes.drafting.prompt_lookup import FloorGuess

    def heard(length: int, guess: int | None) -> RoundOutcome:
        return RoundOutcome(None, PLAIN, 0, (7,), length, guess)

    floor = FloorGuess.__new__(FloorGuess)  # propose reads no engine: the backend is never touched
    sampler = None  # nor the sampler: a floor guess is deterministic
    context = [1, 2, 3, 4]  # no n-gram repeats
    floor.accept(heard(10, 42))
    assert floor.propose(7, context, 1, 10, None, sampler).tokens == [42]  # type: ignore[arg-type]
    assert floor.propose(7, context, 1, 11, None, sampler).tokens == [7]  # type: ignore[arg-type]
    floor.accept(heard(11, None))
    assert floor.propose(7, context, 1, 11, None, sampler).tokens == [7]  # type: ignore[arg-type]
    assert floor.propose(7, [5, 6, 5], 1, 11, None, sampler).tokens == [6]  # type: ignore[arg-type]


def test_the_head_starts_as_the_model_head() -> None:
    """Untrained (down = 0), the block passes h through, so the head guesses what the LM head's
    trimmed rows choose; pack and unpack are inverse."""
    from adaptive_export.graphs.drafts.eagle import EagleBlock, pack, unpack

    block = EagleBlock(8, 16, 1e-6)
    h, e = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(block(h, e), h)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_()
    again = unpack(pack(block), 1e-6)
    torch.testing.assert_close(again(h, e), block(h, e))


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--eagle-head", "5"), "is not a vocabulary size"),
        (("--eagle-head", "no/such/head.safetensors"), "does not exist"),
        (("--eagle-head", "64", "--draft-precision", "int8"), "one draft vocabulary"),
        (("--eagle-head", "64", "--backend", "onnx,coreml"), "ONNX Runtime engines only"),
    ],
)
def test_bad_eagle_options_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], words: str
) -> None:
    from tests.conftest import make_tiny_model

    model = make_tiny_model(tmp_path / "m", layers=2)
    capsys.readouterr()
    assert main(["build", str(model), "-o", str(tmp_path / "b"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert not (tmp_path / "b").exists()


def _eagle_on_prefill(manifest: dict) -> None:
    manifest["graphs"]["prefill"]["eagle"] = 10**6  # wider than any head


def _eagle_role_elsewhere(manifest: dict) -> None:
    manifest["configs"][0]["engines"]["eagle"] = "prefill"


@pytest.mark.parametrize(
    ("edit", "words"),
    [(_eagle_on_prefill, "bad eagle"), (_eagle_role_elsewhere, "as its eagle engine")],
)
def test_a_manifest_breaking_the_eagle_contract_is_refused(
    eagle_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: object, words: str
) -> None:
    """Checksums intact: a head on a graph that is no decode graph, or an eagle engine other than the decode graph."""
    from tests.test_bad_bundles import corrupt_copy, edit_manifest, expect_usage_error

    copy = corrupt_copy(eagle_bundle, tmp_path, edit_manifest(edit))  # type: ignore[arg-type]
    expect_usage_error(["run", str(copy), "-p", "hi", "--mode", "ar"], capsys, words)


def untrained_head_file(path: Path, hidden: int, width: int, ids: list[int]) -> Path:
    """A head as `build --eagle-head` writes it, untrained (the block passes h through)."""
    from safetensors.torch import save

    from adaptive_export.graphs.drafts.eagle import EagleBlock, pack

    table = pack(EagleBlock(hidden, width, 1e-5))
    tensors = {"eagle": table, "ids": torch.tensor(ids, dtype=torch.int32)}
    path.write_bytes(save(tensors, metadata={"acceptance_own_text": "None"}))
    return path


@needs_smollm2
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_gguf_exact_bundle_runs_the_head_and_keeps_plain_tokens(
    tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """SmolLM2's GGUF-exact bundle with a head from a file (`--eagle-head FILE`, no training): its
    decode graph gathers the quantized embedding twice (the tokens' and the head's, each its own
    nodes), ONNX Runtime loads it, the default run decodes two rows with the head on a chat prompt
    ("head" policy) and its tokens equal `--mode ar`'s."""
    from tests.conftest import build_smollm2

    head = untrained_head_file(
        tmp_path_factory.mktemp("head") / "eagle_head.safetensors", 576, 64, list(range(0, 8192, 2))
    )
    # the rule's rows (two for a chat prompt on a bundle with a head): the rows a build measures follow
    # timings (an untrained head's chat rounds sit near the line), and this test is about the head running
    flags = ("--max-len", "256", "--eagle-head", str(head), "--prompt-rows", "rule")
    bundle = build_smollm2(tmp_path_factory, "smol-eagle", *flags)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["graphs"]["decode_full"]["eagle"] == 64 and manifest["backends"]["onnx"]["quantize"] == "native"
    for prompt in ("What is the capital of France?", "Write a haiku about autumn leaves."):
        default = run_json(bundle, prompt, capsys)
        plain = run_json(bundle, prompt, capsys, "--mode", "ar")
        assert default["stats"]["policy"] == "head" and default["stats"]["decode_rows"] == 2
        assert default["tokens"] == plain["tokens"]
        assert default["stats"]["floor_rounds"] > 0


def test_a_head_file_is_checked_against_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--eagle-head FILE` builds without training; ids outside the vocabulary are one error line,
    and a recorded acceptance that is no rate (NaN) is kept as unknown, not written into the manifest."""
    from safetensors.torch import save

    from adaptive_export.graphs.drafts.eagle import EagleBlock, pack
    from tests.conftest import make_tiny_model

    model = make_tiny_model(tmp_path / "m", layers=2)
    table = pack(EagleBlock(64, 32, 1e-6))
    good, foreign = tmp_path / "good.safetensors", tmp_path / "foreign.safetensors"
    good.write_bytes(
        save({"eagle": table, "ids": torch.arange(0, 64, 2, dtype=torch.int32)}, {"acceptance_own_text": "nan"})
    )
    foreign.write_bytes(save({"eagle": table, "ids": torch.tensor([3, 10**6], dtype=torch.int32)}))
    capsys.readouterr()
    assert main(["build", str(model), "-o", str(tmp_path / "bad"), "--eagle-head", str(foreign)]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the loading's progress bar, then one error line
    errors = [line for line in err if line.startswith("error: ")]
    assert errors == err[-1:] and "is no head of this model" in err[-1] and not (tmp_path / "bad").exists()
    assert main(["build", str(model), "-o", str(tmp_path / "b"), "--eagle-head", str(good), "--max-len", "64"]) == 0
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["graphs"]["decode_full"]["eagle"] == 32 and manifest["speculation"]["eagle"]["acceptance"] is None


def parsed_build(*argv: str):  # type: ignore[no-untyped-def]
    from adaptive_export.commands.cli import build_parser
    from adaptive_export.commands.options import BuildOptions

    return BuildOptions.from_args(build_parser().parse_args(["build", *argv]))


@pytest.mark.parametrize(
    ("argv", "shipped"),
    [
        (("smollm2", "-o", "b"), True),  # the default: a packaged model's shipped head
        (("smollm2", "-o", "b", "--backend", "onnx,coreml"), False),  # the head runs in ONNX Runtime only
        (("smollm2", "-o", "b", "--speculate", "auto"), False),  # --speculate chooses its own decoding
        (("smollm2", "-o", "b", "--eagle-head", "0"), False),  # asked off
        (("gemma3", "-o", "b"), False),  # no head shipped for it
    ],
)
def test_eagle_head_auto_takes_a_packaged_models_shipped_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...], shipped: bool
) -> None:
    """`--eagle-head auto` (the default) resolves, before any loading, to samples/heads/<model>.safetensors
    where one ships and the build is plain ONNX Runtime decoding, and to none otherwise."""
    from adaptive_export.loading import shipped_heads

    monkeypatch.setattr(shipped_heads, "SHIPPED_DIR", tmp_path)
    (tmp_path / "smollm2.safetensors").write_bytes(b"stand-in: resolve reads no content")
    value = dict(parsed_build(*argv).draft_options)["eagle"]
    assert value == (str(tmp_path / "smollm2.safetensors") if shipped else "0")


def test_shipped_heads_are_heads_of_their_models() -> None:
    """Every head in samples/heads/ names a packaged model and loads as a head of its width and
    vocabulary (the check `--eagle-head FILE` runs), with a measured acceptance."""
    from safetensors import safe_open

    from adaptive_export.calibration.drafts import eagle
    from adaptive_export.loading.packaged import PACKAGED
    from adaptive_export.loading.shipped_heads import SHIPPED_DIR

    heads = sorted(SHIPPED_DIR.glob("*.safetensors"))
    assert heads, "no shipped head"
    for path in heads:
        assert path.stem in PACKAGED, path
        with safe_open(str(path), framework="pt") as reader:
            table, ids, metadata = reader.get_tensor(eagle.TABLE.key), reader.get_tensor("ids"), reader.metadata()
        assert table.dim() == 2 and table.shape[0] % 5 == 0 and bool(torch.isfinite(table.float()).all())
        assert ids.dim() == 1 and bool((ids[1:] > ids[:-1]).all())
        assert 0.0 < float(metadata["acceptance_own_text"]) < 1.0


def test_a_head_fp16_holds_exactly_is_stored_as_fp16(tmp_path: Path) -> None:
    """The bundle's copy of a shipped (fp16) head keeps half the bytes and reads back the same
    values; a trained fp32 table that fp16 would round stays fp32."""
    from safetensors import safe_open

    from adaptive_export.calibration.drafts import eagle
    from adaptive_export.calibration.drafts.eagle import EagleFit, eagle_bytes
    from adaptive_export.loading.artifacts import load_draft_table

    ids = torch.arange(0, 64, 2)
    exact = torch.randn(10, 8).half().float()
    for table, dtype in ((exact, torch.float16), (exact + 1e-6, torch.float32)):
        path = tmp_path / f"{dtype}.safetensors"
        path.write_bytes(eagle_bytes(EagleFit(table, ids, {"acceptance_own_text": 0.4})))
        with safe_open(str(path), framework="pt") as reader:
            assert reader.get_tensor(eagle.TABLE.key).dtype == dtype
        assert torch.equal(load_draft_table(eagle.TABLE, path, 8), table)
