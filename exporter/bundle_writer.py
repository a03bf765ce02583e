"""Write a bundle atomically: everything goes to a temporary directory beside the target,
which is renamed into place only when complete. An interrupted build leaves the old
bundle (if any) intact and no partial one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from adaptive_export.exporter.old_bundle import (
    RemovalPlan,
    plan_removal,
    remove_planned,
    remove_tree_on_device,
)
from adaptive_export.runtimes.bundle import sha256_of
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import FORMAT, FileEntry, Manifest


def file_table(root: Path) -> dict[str, FileEntry]:
    """sha256 and size of every file under root except the manifest itself."""
    table: dict[str, FileEntry] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != "manifest.json":
            table[rel] = FileEntry(sha256_of(path), path.stat().st_size)
    return table


def is_previous_bundle(target: Path) -> bool:
    """A directory holding an adaptive-export manifest (a regular file, not a symlink)."""
    manifest = target / "manifest.json"
    try:
        if (
            target.is_symlink()
            or not target.is_dir()
            or manifest.is_symlink()
            or not manifest.is_file()
            or manifest.stat().st_size > (16 << 20)
        ):
            return False
        return json.loads(manifest.read_bytes()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def check_output_dir(target: Path, force: bool, protect: tuple[Path, ...] = ()) -> None:
    """Refuse to overwrite unless asked, and fail before any work if the parent is unwritable.

    --force only ever replaces a previous bundle: never a directory without an
    adaptive-export manifest, and never the working directory, the model being exported
    (`protect`) or a directory that contains either."""
    resolved = target.resolve()
    if not target.name or resolved == Path(resolved.anchor):
        raise UsageError(
            f"output path {str(target)!r} names no directory of its own",
            "choose a new directory such as -o bundles/mymodel",
        )
    if (target.exists() or target.is_symlink()) and not force:
        raise UsageError(
            f"output directory {str(target)!r} already exists", "pass --force to replace it, or choose another -o"
        )
    for kept in (Path.cwd(), *protect):
        kept = kept.resolve()
        if kept == resolved or kept.is_relative_to(resolved):
            raise UsageError(
                f"output directory {str(target)!r} is or contains {str(kept)!r}, which a build never replaces",
                "choose another -o, outside the model and the working directory",
            )
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise UsageError(f"output path {str(target)!r} exists and is not a directory", "choose another -o")
    if target.exists() and not is_previous_bundle(target):
        raise UsageError(
            f"output directory {str(target)!r} is not an adaptive-export bundle, so --force will not replace it",
            "choose another -o, or remove that directory yourself",
        )
    if target.exists():
        plan_removal(target)  # refuses links, mounts and unlisted files before any work
    parent = target.parent if str(target.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"cannot create the parent directory of {str(target)!r}: {exc.strerror}",
            "choose an output directory you can write to",
        ) from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write to {str(parent)!r}", "choose an output directory you can write to")


def remove_stale_partials(target: Path) -> list[Path]:
    """Remove staging dirs of builds that were killed (SIGKILL, power loss): their pid is gone."""
    removed = []
    for stale in target.parent.glob(f".{target.name}.partial-*"):
        pid_text = stale.name.rsplit("-", 2)[-2] if stale.name.count("-") >= 2 else ""
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            remove_tree_on_device(stale)
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


class Interrupts:
    """SIGINT/SIGTERM during a build. The CLI's handler records the request here before it
    raises KeyboardInterrupt, so an interrupt that a library swallows (or turns into another
    exception) still aborts the build at the commit below: the old bundle stays, exit 130."""

    requested = False
    managed = False  # True when the CLI owns the signal handlers (not for in-process callers)


def request_interrupt() -> None:
    Interrupts.requested = True


def _hold_before_commit() -> None:
    """Test seam (tests/test_atomic_build.py): ADAPTIVE_EXPORT_HOLD_BEFORE_COMMIT=FILE makes the
    build wait, complete but uncommitted, while FILE exists, so a test can signal it at a
    known point; a value 'swallow:FILE' also swallows KeyboardInterrupt while waiting, as a
    library catching broad exceptions would."""
    hold = os.environ.get("ADAPTIVE_EXPORT_HOLD_BEFORE_COMMIT")
    if not hold:
        return
    swallow = hold.startswith("swallow:")
    hold_path = Path(hold.removeprefix("swallow:"))
    (hold_path.parent / (hold_path.name + ".reached")).touch()
    deadline = time.monotonic() + 120
    while hold_path.exists() and time.monotonic() < deadline:
        try:
            time.sleep(0.02)
        except KeyboardInterrupt:
            if not swallow:
                raise


@contextlib.contextmanager
def staging_dir(target: Path, force: bool) -> Iterator[Path]:
    """Yield a temp dir beside target; on success it replaces target, on failure it is removed."""
    check_output_dir(target, force)
    remove_stale_partials(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    try:
        yield staging
    except OSError as exc:
        remove_tree_on_device(staging)
        raise UsageError(
            f"writing the bundle failed: {exc.strerror or exc}",
            "free disk space or choose another -o, then build again",
        ) from exc
    except BaseException:
        remove_tree_on_device(staging)
        raise
    try:
        _hold_before_commit()
    except BaseException:
        remove_tree_on_device(staging)
        raise
    _commit(staging, target)


def _record_only(signum: int, frame: object) -> None:
    request_interrupt()


def _replaceable(target: Path) -> RemovalPlan | None:
    """What --force deletes of the directory now at target (None: nothing there)."""
    if not (target.exists() or target.is_symlink()):
        return None
    if not is_previous_bundle(target):
        raise UsageError(
            f"output directory {str(target)!r} changed during the build and is no longer a bundle",
            "choose another -o, or remove that directory yourself",
        )
    return plan_removal(target)


def _commit(staging: Path, target: Path) -> None:
    """The point of no return. Under the CLI, SIGINT/SIGTERM only record a request while
    the bundle is swapped in, so no KeyboardInterrupt can land between the two renames; a
    request recorded at any time before the final check below (even one a library
    swallowed) puts the old bundle back and ends in exit 130. After that check the build
    is complete and later signals are ignored."""
    managed = Interrupts.managed and threading.current_thread() is threading.main_thread()
    try:
        if managed:
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, _record_only)
        if Interrupts.requested:
            raise KeyboardInterrupt
        plan = _replaceable(target)  # checked again: it may have changed during the build
    except BaseException:
        remove_tree_on_device(staging)
        raise
    old = None
    if plan is not None:
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        os.rename(target, old)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp made it private; a bundle is a normal directory
    os.rename(staging, target)
    if managed:
        if Interrupts.requested:  # arrived during the swap: undo it
            os.rename(target, staging)
            if old is not None:
                os.rename(old, target)
            remove_tree_on_device(staging)
            raise KeyboardInterrupt
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    if old is not None and plan is not None:
        remove_planned(old, plan)


def write_manifest(root: Path, manifest: Manifest) -> Manifest:
    """Write manifest.json listing every file now under root; returns the manifest written."""
    manifest = replace(manifest, files=file_table(root))
    (root / "manifest.json").write_text(json.dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n")
    return manifest
