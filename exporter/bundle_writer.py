"""Write a bundle atomically: everything goes to a temporary directory beside the target,
which is renamed into place only when complete. An interrupted build leaves the old
bundle (if any) intact and no partial one.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from runtimes.bundle import sha256_of
from runtimes.errors import UsageError


def file_table(root: Path) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under root except the manifest itself."""
    table: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != "manifest.json":
            table[rel] = {"sha256": sha256_of(path), "bytes": path.stat().st_size}
    return table


def check_output_dir(target: Path, force: bool) -> None:
    """Refuse to overwrite unless asked, and fail before any work if the parent is unwritable."""
    if target.exists() and not force:
        raise UsageError(f"output directory {str(target)!r} already exists", "pass --force to replace it, or choose another -o")
    if target.exists() and not target.is_dir():
        raise UsageError(f"output path {str(target)!r} exists and is not a directory", "choose another -o")
    parent = target.parent if str(target.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create the parent directory of {str(target)!r}: {exc.strerror}", "choose an output directory you can write to") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write to {str(parent)!r}", "choose an output directory you can write to")


def remove_stale_partials(target: Path) -> list[Path]:
    """Remove staging dirs of builds that were killed (SIGKILL, power loss): their pid is gone."""
    removed = []
    for stale in target.parent.glob(f".{target.name}.partial-*"):
        pid_text = stale.name.rsplit("-", 2)[-2] if stale.name.count("-") >= 2 else ""
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def staging_dir(target: Path, force: bool) -> Iterator[Path]:
    """Yield a temp dir beside target; on success it replaces target, on failure it is removed."""
    check_output_dir(target, force)
    remove_stale_partials(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    try:
        yield staging
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise UsageError(f"writing the bundle failed: {exc.strerror or exc}", "free disk space or choose another -o, then build again") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        os.rename(target, old)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp made it private; a bundle is a normal directory
    os.rename(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    manifest = dict(manifest, files=file_table(root))
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
