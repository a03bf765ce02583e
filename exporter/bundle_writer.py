"""Write a bundle atomically: everything goes to a temporary directory beside the target,
which is renamed into place only when complete. An interrupted build leaves the old
bundle (if any) intact and no partial one.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
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
        if rel not in ("manifest.json", PARTIAL_MARKER):
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
    if os.statvfs(parent).f_flag & os.ST_RDONLY:
        raise UsageError(
            f"{str(parent)!r} is on a read-only filesystem, so it cannot hold a bundle",
            "choose an output directory on a writable disk, e.g. -o bundles/mymodel",
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write to {str(parent)!r}", "choose an output directory you can write to")
    check_can_hold_bundle(target, parent)
    remove_stale_partials(target)  # a live build's partial is refused here, before any loading


def check_can_hold_bundle(target: Path, parent: Path) -> None:
    """Make and remove a small staging-like directory with a file in it, so a place that cannot
    hold a bundle (/proc, /sys, a read-only filesystem) fails here in one line, before the
    loading, instead of at the staging dir after minutes of work. os.access cannot tell: it
    says yes to root on /proc and ignores read-only mounts."""
    probe: Path | None = None
    try:
        probe = Path(tempfile.mkdtemp(prefix=f".{target.name}.probe-", dir=parent))
        fd = os.open(probe / "probe", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"adaptive-export")
        finally:
            os.close(fd)
    except OSError as exc:
        raise UsageError(
            f"{str(parent)!r} cannot hold a bundle ({exc.strerror or exc})",
            "choose an output directory on a writable disk, e.g. -o bundles/mymodel",
        ) from None
    finally:
        if probe is not None:
            remove_tree_on_device(probe)


PARTIAL_MARKER = ".adaptive-export-partial"  # inside every staging dir; never part of a bundle
_MARKER_TOOL = "adaptive-export staging directory"


@dataclass(frozen=True)
class StagingOwner:
    """The marker a build writes into its staging dir: who owns it, and the open file whose flock
    says the owner is alive (the kernel drops the lock when the process dies, SIGKILL included,
    so a reused pid can never make a dead build's partial look alive)."""

    fd: int
    pid: int
    start: str


def _process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), '' where
    unknown: with the pid it names one process, even after the pid is reused."""
    try:
        stat_text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat_text.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else ""


def claim_staging(staging: Path) -> StagingOwner:
    """Mark `staging` as this process's and lock the marker. The marker is written and locked under
    a temporary name, then renamed into place, so a marker that another build can see is always
    locked by a live owner or left by a dead one, never half-made."""
    pid, start = os.getpid(), _process_start(os.getpid())
    temporary = staging / (PARTIAL_MARKER + ".new")
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"tool": _MARKER_TOOL, "pid": pid, "start": start}).encode())
    os.rename(temporary, staging / PARTIAL_MARKER)
    return StagingOwner(fd, pid, start)


def release_staging(staging: Path, owner: StagingOwner) -> None:
    """Remove the marker (a bundle lists every file it holds) and drop the lock."""
    with contextlib.suppress(OSError):
        os.unlink(staging / PARTIAL_MARKER)
    with contextlib.suppress(OSError):
        os.close(owner.fd)


def _marker_of(candidate: Path) -> dict[str, object] | None:
    """The marker's contents when `candidate` is a staging dir this tool made (a real directory,
    not a link or a mount, holding a regular-file marker with this tool's name); else None."""
    try:
        info = os.lstat(candidate)
        marker = candidate / PARTIAL_MARKER
        if not stat.S_ISDIR(info.st_mode) or os.path.ismount(candidate) or info.st_uid != os.getuid():
            return None
        if not stat.S_ISREG(os.lstat(marker).st_mode) or os.lstat(marker).st_size > 4096:
            return None
        data = json.loads(marker.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and data.get("tool") == _MARKER_TOOL else None


def _owner_alive(candidate: Path, data: dict[str, object]) -> bool:
    """Whether the build that made `candidate` still runs: its marker's flock is held. Where
    flock is unsupported (some network filesystems), its pid and start time are compared."""
    try:
        fd = os.open(candidate / PARTIAL_MARKER, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return True  # gone or unreadable: not ours to judge, leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        pid = data.get("pid")
        return isinstance(pid, int) and _pid_alive(pid) and _process_start(pid) == data.get("start")
    finally:
        os.close(fd)  # closing drops our lock; the directory is removed right after
    return False


def remove_stale_partials(target: Path) -> list[Path]:
    """Remove the staging dirs of this target whose build was killed (SIGKILL, power loss), and
    refuse (exit 2) while another live build writes one. Only directories holding this tool's
    marker are candidates; anything else that merely matches the name is left alone."""
    removed = []
    for candidate in sorted(target.parent.glob(f".{glob.escape(target.name)}.partial-*")):
        data = _marker_of(candidate)
        if data is None:
            continue
        if _owner_alive(candidate, data):
            raise UsageError(
                f"another build (pid {data.get('pid')}) is writing {str(target)!r} (its staging "
                f"directory {candidate.name!r} is locked)",
                "wait for that build to finish or stop it, then build again",
            )
        remove_tree_on_device(candidate)
        removed.append(candidate)
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
    hold = os.environ.get(HOLD_VARIABLE)
    if hold:  # the test seam's acknowledgement: the signal has reached this process's handler
        with contextlib.suppress(OSError):
            Path(hold.removeprefix("swallow:") + ".interrupted").touch()


HOLD_VARIABLE = "ADAPTIVE_EXPORT_HOLD_BEFORE_COMMIT"
HOLD_MAX_S = 900  # a forgotten hold file cannot keep a build waiting forever


def _hold_before_commit() -> None:
    """Test seam (tests/test_atomic_build.py): ADAPTIVE_EXPORT_HOLD_BEFORE_COMMIT=FILE makes the
    build wait, complete but uncommitted, while FILE exists, so a test can signal it at a
    known point; a value 'swallow:FILE' also swallows KeyboardInterrupt while waiting, as a
    library catching broad exceptions would. FILE.reached says the build is waiting, and
    FILE.interrupted that a signal has been recorded (request_interrupt)."""
    hold = os.environ.get(HOLD_VARIABLE)
    if not hold:
        return
    swallow = hold.startswith("swallow:")
    hold_path = Path(hold.removeprefix("swallow:"))
    (hold_path.parent / (hold_path.name + ".reached")).touch()
    deadline = time.monotonic() + HOLD_MAX_S
    while hold_path.exists() and time.monotonic() < deadline:
        try:
            time.sleep(0.02)
        except KeyboardInterrupt:
            if not swallow:
                raise


@contextlib.contextmanager
def staging_dir(target: Path, force: bool) -> Iterator[Path]:
    """Yield a temp dir beside target; on success it replaces target, on failure it is removed.
    The dir holds a locked marker while the build runs (claim_staging), so a later build can tell
    a killed build's leftover (removed) from a live build's (refused)."""
    check_output_dir(target, force)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
    owner: StagingOwner | None = None
    try:
        owner = claim_staging(staging)
        try:
            yield staging
        except OSError as exc:
            raise UsageError(
                f"writing the bundle failed: {exc.strerror or exc}",
                "free disk space or choose another -o, then build again",
            ) from exc
        _hold_before_commit()
        _commit(staging, target)
    except BaseException:
        remove_tree_on_device(staging)
        raise
    finally:
        if owner is not None:
            release_staging(staging, owner)


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
        # a fresh empty name (rename replaces an empty directory): a fixed .old-PID name collides
        # with one left by a build of the same pid killed here (containers reuse pids), ENOTEMPTY
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-{os.getpid()}-", dir=target.parent))
        os.rename(target, old)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp made it private; a bundle is a normal directory
    with contextlib.suppress(FileNotFoundError):
        os.unlink(staging / PARTIAL_MARKER)  # never part of a bundle (the lock itself lives on its open fd)
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
