"""Bad bundles and bad arguments: exit code 2 and one line naming the problem and the fix."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from adaptive_export.commands.cli import main


def corrupt_copy(bundle: Path, tmp_path: Path, mutate: Callable[[Path], None]) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    mutate(copy)
    return copy


def edit_manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def mutate(root: Path) -> None:
        manifest = json.loads((root / "manifest.json").read_text())
        edit(manifest)
        (root / "manifest.json").write_text(json.dumps(manifest))

    return mutate


def expect_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str], *fragments: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and "Fix:" in err, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    return err


BAD_BUNDLES: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing_engine_file": (lambda r: (r / "onnx" / "prefill.onnx").unlink(), "is missing"),
    "manifest_missing": (lambda r: (r / "manifest.json").unlink(), "has no manifest.json"),
    "manifest_not_json": (lambda r: (r / "manifest.json").write_text("{not json"), "not valid JSON"),
    "manifest_not_object": (lambda r: (r / "manifest.json").write_text("[1, 2]"), "not a JSON object"),
    "unknown_schema": (edit_manifest(lambda m: m.update(schema_version=99)), "schema_version 99"),
    "missing_key": (edit_manifest(lambda m: m.pop("graphs")), "missing key 'graphs'"),
    "wrong_type": (edit_manifest(lambda m: m.update(max_len="long")), "key 'max_len' has the wrong type"),
    "checksum_mismatch": (
        lambda r: (r / "tokenizer.json").write_text((r / "tokenizer.json").read_text().replace('"', "'", 1)[:-1] + " "),
        "tokenizer.json",
    ),
    "path_escape_dotdot": (
        edit_manifest(lambda m: m["files"].update({"../outside": {"sha256": "0", "bytes": 1}})),
        "outside the bundle",
    ),
    "path_absolute": (
        edit_manifest(lambda m: m["files"].update({"/etc/passwd": {"sha256": "0", "bytes": 1}})),
        "not a relative path",
    ),
    "prompt_tokens_negative": (
        edit_manifest(lambda m: m["graphs"]["decode_full"].update(prompt_tokens=-1)),
        "bad prompt_tokens",
    ),
    "prompt_tokens_huge": (
        edit_manifest(lambda m: m["graphs"]["decode_full"].update(prompt_tokens=10**9)),
        "bad prompt_tokens",
    ),
    "prompt_tokens_engine_without_prompts": (
        edit_manifest(lambda m: m["configs"][0]["engines"].update(prompt_tokens="decode_full")),
        "prompt_tokens engine",
    ),
    "engine_of_unknown_role": (
        edit_manifest(lambda m: m["configs"][0]["engines"].update(evil="decode_full")),
        "engine of unknown role 'evil'",
    ),
    "foreign_manifest": (edit_manifest(lambda m: m.update(format="something-else")), "not an adaptive-export bundle"),
}


@pytest.mark.parametrize("case", sorted(BAD_BUNDLES))
def test_bad_bundle_is_rejected(
    case: str, tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mutate, fragment = BAD_BUNDLES[case]
    copy = corrupt_copy(tiny_bundle, tmp_path, mutate)
    expect_usage_error(["run", str(copy), "-p", "hi"], capsys, fragment)


def test_symlink_out_of_bundle_is_rejected(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text("{}")

    def mutate(root: Path) -> None:
        (root / "tokenizer.json").unlink()
        os.symlink(outside, root / "tokenizer.json")

    copy = corrupt_copy(tiny_bundle, tmp_path, mutate)
    expect_usage_error(["run", str(copy), "-p", "hi"], capsys, "outside the bundle")


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["run", "{b}", "-p", "hi", "--max-new-tokens", "0"], "max-new-tokens must be a positive integer"),
        (["run", "{b}", "-p", "hi", "--max-new-tokens", "500"], "exceeds the bundle's max_len"),
        (["run", "{b}", "-p", "hi", "--temperature", "-1"], "temperature -1.0 is invalid"),
        (["run", "{b}", "-p", "hi", "--top-p", "0"], "top-p 0.0 is outside (0, 1]"),
        (["run", "{b}", "-p", "hi", "--top-p", "1.5"], "top-p 1.5 is outside (0, 1]"),
        (["run", "{b}", "-p", "   "], "the prompt is empty"),
        (["run", "{b}", "-p", "hi", "--config", "nope"], "unknown configuration 'nope'"),
        (["run", "{b}", "-p", "hi", "--backend", "coreml"], "backend 'coreml' is not in this bundle"),
        (["run", "{b}", "-p", "hi", "--backend", "vulkan"], "backend 'vulkan' is unknown"),
        (["run", "{b}", "-p", "hi", "--mode", "spec", "--draft", "early_exit"], "has no early_exit draft engines"),
        (
            ["run", "{b}", "-p", "hi", "--mode", "spec", "--draft", "prompt_tokens"],
            "has no prompt_tokens draft engines",
        ),
        (["build", "{m}", "-o", "{t}/o", "--prompt-tokens", "99"], "--prompt-tokens 99 is outside 1..16"),
        (["build", "{m}", "-o", "{t}/o", "--prompt-tokens", "{t}/nope.safetensors"], "prompt tokens file"),
        (["run", "{t}/does-not-exist", "-p", "hi"], "does not exist"),
        (["run", "{t}", "-p", "hi"], "has no manifest.json"),
        (["run", "{b}", "--prompt-file", "{t}/nope.txt"], "does not exist"),
        (["run", "{b}", "--prompt-file", "{t}/latin1.txt"], "not valid UTF-8"),
        (["build", "{t}/no-model", "-o", "{t}/out"], "does not exist"),
        (["build", "{t}/latin1.txt", "-o", "{t}/out"], "neither a .gguf file nor"),
        (["build", "{b}", "-o", "{b}"], "already exists"),
        (["build", "{m}", "-o", "{t}/o", "--backend", "onnx,metal"], "unknown backend 'metal'"),
        (["check", "{b}", "--prompts", "{t}/latin1.txt"], "not UTF-8"),
        (["check", "{b}", "--prompts", "{t}/bad.jsonl"], "lacks a non-empty string 'prompt'"),
        (["inspect", "{t}/does-not-exist"], "does not exist"),
        (["build", "{m}", "-o", "{t}/o", "--quantize", "int4", "--quant-block", "48"], "not a power of two"),
        (["build", "{m}", "-o", "{t}/o", "--quantize", "int8", "--quant-accuracy", "7"], "accuracy level 7"),
        (["frobnicate"], "bad arguments"),
    ],
)
def test_bad_arguments(
    argv: list[str],
    fragment: str,
    tiny_bundle: Path,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt field"}\n')
    argv = [a.format(b=tiny_bundle, t=tmp_path, m=tiny_model_dir) for a in argv]
    expect_usage_error(argv, capsys, fragment)


def test_unwritable_output_directory(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A parent path that is a file cannot hold a bundle (works as root too, unlike chmod)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    expect_usage_error(
        ["build", str(tiny_model_dir), "-o", str(blocker / "b")], capsys, "cannot create the parent directory"
    )


def test_unsupported_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GPT-2 config is read (no weights needed) and refused, naming what is supported."""
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 50257})
    )
    expect_usage_error(
        ["build", str(model), "-o", str(tmp_path / "o")], capsys, "model type 'gpt2' is not supported", "llama"
    )


@pytest.mark.parametrize(
    "content,fragment",
    [("prompt: not json\n", "is not JSON"), ('{"text": "no prompt"}\n', "lacks a non-empty string 'prompt'")],
)
def test_bad_calibration_file(
    content: str, fragment: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calib = tmp_path / "calib.jsonl"
    calib.write_text(content)
    expect_usage_error(
        ["build", str(tiny_model_dir), "-o", str(tmp_path / "o"), "--routers", "train", "--calib", str(calib)],
        capsys,
        fragment,
    )
