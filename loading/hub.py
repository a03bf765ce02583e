"""A MODEL argument that names a Hugging Face Hub repository (`org/name`), resolved to a local
snapshot: from the cache first, downloaded only when the hub is reachable and the user did not set
HF_HUB_OFFLINE=1. What the cache holds is a model file like any other: loading/model.py checks the
resolved files (loading/model_checks.py) before any library parses them, and the resolved path must
stay inside the repository's cache folder (a hostile ref or symlink cannot point elsewhere).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from adaptive_export.runtimes.errors import UsageError

_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
HUB_ID = re.compile(rf"{_PART}/{_PART}")
REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")
GGUF_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}\.gguf")
# the files a transformers checkpoint needs; never pickles (*.bin, *.pt), whose loading could run code
MODEL_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja")
_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class HubModel:
    """A Hub repository, the revision to take (None: the default branch) and, for a GGUF repository, its file."""

    repo_id: str
    revision: str | None = None
    gguf_file: str | None = None


def is_hub_id(model: str) -> bool:
    """`org/name` with the Hub's characters; `..` and `--` are never part of a name."""
    return bool(HUB_ID.fullmatch(model)) and ".." not in model and "--" not in model


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as the user set it, read now (huggingface_hub reads it once, at its import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps snapshots: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def resolve_hub_model(ref: HubModel) -> Path:
    """The local model directory (or .gguf file) of a Hub repository: the cached snapshot, else a download."""
    _check_names(ref)
    cache = hub_cache_dir()
    patterns = [ref.gguf_file] if ref.gguf_file else list(MODEL_FILES)
    snapshot = _cached_snapshot(ref, cache, patterns)
    if snapshot is None:
        if hub_offline():
            raise UsageError(
                f"model {ref.repo_id!r} is not in the Hugging Face cache ({cache}) and the hub is offline",
                f"download it once with `huggingface-cli download {ref.repo_id}`, or unset HF_HUB_OFFLINE",
            )
        snapshot = _download(ref, cache, patterns)
    _check_inside(snapshot, cache / ("models--" + ref.repo_id.replace("/", "--")), ref)
    return _model_path(snapshot, ref)


def snapshot_blob(path: Path) -> Path:
    """A file of a Hub snapshot is a link into its repository's blobs: that blob, a regular file the
    checks open without following links. Any other path (and a link elsewhere) comes back unchanged."""
    snapshot = next((p for p in path.parents if p.parent.name == "snapshots"), None)
    if snapshot is None or not path.is_symlink() or not snapshot.parent.parent.name.startswith("models--"):
        return path
    target = path.resolve()
    return target if target.parent == (snapshot.parent.parent / "blobs").resolve() else path


def _check_names(ref: HubModel) -> None:
    if ref.revision is not None and (not REVISION.fullmatch(ref.revision) or ".." in ref.revision):
        raise UsageError(
            f"--revision {ref.revision!r} is not a Hub branch, tag or commit name",
            "pass a branch, a tag or a commit hash (letters, digits, '.', '_', '-', '/')",
        )
    if ref.gguf_file is not None and (not GGUF_NAME.fullmatch(ref.gguf_file) or ".." in ref.gguf_file):
        raise UsageError(
            f"--gguf-file {ref.gguf_file!r} is not a .gguf file name inside a repository",
            "pass the file's name as the repository lists it, e.g. model-Q4_K_M.gguf",
        )


def _cached_snapshot(ref: HubModel, cache: Path, patterns: list[str]) -> Path | None:
    """The snapshot folder the cache holds for this revision, or None (never the network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        found = snapshot_download(
            ref.repo_id, revision=ref.revision, cache_dir=cache, local_files_only=True, allow_patterns=patterns
        )
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None
    except (OSError, ValueError) as exc:  # an unreadable or malformed cache folder
        raise UsageError(
            f"cannot read model {ref.repo_id!r} from the Hugging Face cache ({cache}): {_first_line(exc)}",
            f"remove its folder from the cache and download it again: `huggingface-cli download {ref.repo_id}`",
        ) from None
    return Path(found)


def _download(ref: HubModel, cache: Path, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache, allow_patterns=patterns))
    except Exception as exc:  # huggingface_hub raises HTTP, network, auth and file errors of many types
        raise UsageError(
            f"cannot download model {ref.repo_id!r} from the Hugging Face hub: {_first_line(exc)}",
            "check the id, --revision and the network (or `huggingface-cli login` for a gated model)",
        ) from None


def _check_inside(snapshot: Path, repo_folder: Path, ref: HubModel) -> None:
    """The snapshot and every file it links to stay inside the repository's cache folder."""
    root = repo_folder.resolve()
    paths = [snapshot, *snapshot.rglob("*")]
    if any(not path.resolve().is_relative_to(root) for path in paths):
        raise UsageError(
            f"the Hugging Face cache entry of {ref.repo_id!r} points outside its folder ({repo_folder})",
            f"remove that folder and download the model again: `huggingface-cli download {ref.repo_id}`",
        )


def _model_path(snapshot: Path, ref: HubModel) -> Path:
    """The snapshot folder of a transformers checkpoint, or the requested .gguf file in it."""
    if ref.gguf_file:
        path = snapshot / ref.gguf_file
        if not path.is_file():
            raise UsageError(
                f"model {ref.repo_id!r} has no file {ref.gguf_file!r}",
                "pass --gguf-file with one of the repository's .gguf file names",
            )
        return path
    if not (snapshot / "config.json").is_file():
        ggufs = sorted(p.name for p in snapshot.glob("*.gguf"))
        hint = f" (cached: {', '.join(ggufs[:5])})" if ggufs else ""
        raise UsageError(
            f"model {ref.repo_id!r} has no config.json: a GGUF repository needs the file to build from",
            f"pass --gguf-file NAME{hint}",
        )
    return snapshot


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
