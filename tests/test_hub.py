"""MODEL as a Hugging Face Hub id (loading/hub.py): resolved from a cache laid out as huggingface_hub
writes it (models--org--name/{blobs,refs,snapshots/<commit>}), built in the test from a tiny random
model, with HF_HUB_OFFLINE=1, so nothing is ever downloaded. What the cache holds is checked like
any model file the user builds from."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from adaptive_export.commands.cli import main
from adaptive_export.loading.model import check_model_files, resolve_model_argument
from adaptive_export.runtimes.errors import UsageError
from tests.conftest import make_tiny_model

REPO = "tiny-org/tiny-llama"


def cache_snapshot(cache: Path, repo_id: str, files: Path, ref: str = "main") -> Path:
    """Put every file of `files` into the cache as one commit of `repo_id` that `ref` names: the blobs by
    sha256, the snapshot's files relative links to them, refs/<ref> holding the commit hash."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(f"{repo_id}@{ref}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(files.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hub") / "model", layers=2)


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and ". Fix: " in lines[0], lines
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_build_from_a_cached_hub_id_offline(tiny_dir: Path, offline_cache: Path, tmp_path: Path) -> None:
    """The bundle records the snapshot it was built from; `check --model <the id>` resolves the id
    through the same offline cache and passes, and greedy decoding equals the local directory's HF model."""
    import torch

    from adaptive_export.loading.model import load_model
    from adaptive_export.runtimes import Generator

    snapshot = cache_snapshot(offline_cache, REPO, tiny_dir)
    out = tmp_path / "bundle"
    # the default (fused) flavour: what is tested is the Hub id's resolution, and a portable export
    # costs about 30 s of CPU on 2 cores against 4 s (both flavours are checked against HF elsewhere)
    assert main(["build", REPO, "-o", str(out), "--max-len", "64"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["source"] == str(snapshot.resolve())
    assert main(["check", str(out), "--model", REPO, "--new-tokens", "4"]) == 0
    hf = load_model(str(tiny_dir))
    ids = hf.tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    ours = Generator(out).generate(ids, max_new_tokens=8, raw=True).tokens
    with torch.no_grad():
        theirs = hf.hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=[])
    assert ours == theirs[0, len(ids) :].tolist()


def test_missing_hub_id_offline_is_one_line(offline_cache: Path, tmp_path: Path, capsys) -> None:
    line = refused(["build", "org/x", "-o", str(tmp_path / "b")], capsys)
    assert line == (
        f"error: model 'org/x' is not in the Hugging Face cache ({offline_cache}) and the hub is offline. "
        "Fix: download it once with `huggingface-cli download org/x`, or unset HF_HUB_OFFLINE"
    )
    assert not (tmp_path / "b").exists()


def test_hf_hub_cache_wins_over_hf_home(tiny_dir: Path, offline_cache: Path, tmp_path: Path, monkeypatch) -> None:
    other = tmp_path / "elsewhere"
    snapshot = cache_snapshot(other, REPO, tiny_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert resolve_model_argument(REPO) == str(snapshot)


def test_a_local_directory_of_the_same_name_wins(
    tiny_dir: Path, offline_cache: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_dir, tmp_path / REPO)
    assert resolve_model_argument(REPO) == REPO  # not looked up in the (empty) cache
    assert check_model_files(REPO) == (Path(REPO), None)
    refused(["build", REPO, "-o", "b", "--revision", "v1"], capsys, "--revision", "Hub id")


def test_revision_picks_its_snapshot(tiny_dir: Path, offline_cache: Path, tmp_path: Path) -> None:
    main_snapshot = cache_snapshot(offline_cache, REPO, tiny_dir)
    tagged = tmp_path / "tagged"
    shutil.copytree(tiny_dir, tagged)
    config = json.loads((tagged / "config.json").read_text())
    (tagged / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    v1 = cache_snapshot(offline_cache, REPO, tagged, ref="v1")
    assert resolve_model_argument(REPO) == str(main_snapshot)
    assert resolve_model_argument(REPO, revision="v1") == str(v1)
    assert resolve_model_argument(REPO, revision=v1.name) == str(v1)  # a commit hash
    with pytest.raises(UsageError, match="not in the Hugging Face cache"):
        resolve_model_argument(REPO, revision="v2")


def test_gguf_repository_takes_gguf_file(offline_cache: Path, tmp_path: Path, capsys) -> None:
    from tests.test_model_input_hardening import write_tiny_gguf

    files = tmp_path / "files"
    files.mkdir()
    write_tiny_gguf(files / "tiny-f32.gguf")
    snapshot = cache_snapshot(offline_cache, "org/tiny-gguf", files)
    path = resolve_model_argument("org/tiny-gguf", gguf_file="tiny-f32.gguf")
    assert path == str(snapshot / "tiny-f32.gguf")
    assert check_model_files(path) == (snapshot, "tiny-f32.gguf")  # the header read through the cache's link
    refused(["build", "org/tiny-gguf", "-o", str(tmp_path / "b")], capsys, "--gguf-file", "tiny-f32.gguf")
    refused(["build", "org/tiny-gguf", "-o", str(tmp_path / "b"), "--gguf-file", "other.gguf"], capsys, "other.gguf")


def test_hostile_gguf_in_the_cache_is_refused(offline_cache: Path, tmp_path: Path, capsys) -> None:
    from tests.test_model_input_hardening import write_tiny_gguf

    files = tmp_path / "files"
    files.mkdir()
    write_tiny_gguf(files / "dims.gguf", embedding_length=10**9)
    cache_snapshot(offline_cache, "org/bad-gguf", files)
    argv = ["build", "org/bad-gguf", "--gguf-file", "dims.gguf", "-o", str(tmp_path / "b")]
    refused(argv, capsys, "hidden_size")


def test_hostile_config_in_the_cache_is_refused(tiny_dir: Path, offline_cache: Path, tmp_path: Path, capsys) -> None:
    files = tmp_path / "files"
    shutil.copytree(tiny_dir, files)
    config = json.loads((files / "config.json").read_text())
    (files / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**9}))
    cache_snapshot(offline_cache, REPO, files)
    refused(["build", REPO, "-o", str(tmp_path / "b")], capsys, "num_hidden_layers")


def test_cache_links_outside_the_repository_are_refused(
    tiny_dir: Path, offline_cache: Path, tmp_path: Path, capsys
) -> None:
    snapshot = cache_snapshot(offline_cache, REPO, tiny_dir)
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(secret)
    refused(["build", REPO, "-o", str(tmp_path / "b")], capsys, "points outside")


def test_a_ref_outside_the_snapshots_is_refused(tiny_dir: Path, offline_cache: Path, tmp_path: Path, capsys) -> None:
    snapshot = cache_snapshot(offline_cache, REPO, tiny_dir)
    escape = tmp_path / "escape"
    shutil.copytree(snapshot, escape, symlinks=False)
    (snapshot.parents[1] / "refs" / "main").write_text(os.path.relpath(escape, snapshot.parent))
    line = refused(["build", REPO, "-o", str(tmp_path / "b")], capsys)
    assert "points outside" in line or "not in the Hugging Face cache" in line


@pytest.mark.parametrize(
    ("option", "value"), [("--revision", "../../x"), ("--gguf-file", "../a.gguf"), ("--gguf-file", "/etc/a.gguf")]
)
def test_bad_revision_and_file_names_are_refused(offline_cache: Path, tmp_path: Path, capsys, option, value) -> None:
    refused(["build", REPO, "-o", str(tmp_path / "b"), option, value], capsys, option)


def test_hub_ids_are_told_from_paths() -> None:
    from adaptive_export.loading.hub import is_hub_id

    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("org/x")
    for text in ("smollm2", "a/b/c", "../x", "org/..", "/abs/x", "org/x.gguf/", "a--b/c", "org/-x"):
        assert not is_hub_id(text), text
