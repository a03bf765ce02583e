"""Remove a previous bundle for `build --force`, file by file, never across a filesystem boundary.

A recursive delete of the old bundle would follow the user's bind or FUSE mount (or a
symlink) placed inside it and empty whatever is mounted there, such as the model being
exported. So `--force` deletes only what the old bundle's own manifest lists (its `files`,
manifest.json, and the directories holding them, bottom-up, only when empty) and refuses,
before any work, a bundle holding anything else: a symlink, a mount point, a directory on
another device, an unlisted file. docs/hardening.md, "--force and filesystem boundaries".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import path_problem

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class RemovalPlan:
    """What --force may delete: the old bundle's listed files and their directories, deepest first."""

    files: tuple[str, ...]
    directories: tuple[str, ...]
    device: int  # the old bundle's st_dev: nothing on another device is removed
    mounts: frozenset[str]  # mount points seen when planning (a bind mount shares st_dev)


def mount_points() -> frozenset[str]:
    """Every mount point of this process (Linux /proc/self/mountinfo; empty elsewhere). A bind
    mount of a directory of the same filesystem has the same st_dev and is invisible to
    os.path.ismount, so this list is the one check that sees it."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as handle:
            fields = [line.split(" ") for line in handle]
    except OSError:
        return frozenset()
    unescape = re.compile(r"\\([0-7]{3})")
    return frozenset(unescape.sub(lambda m: chr(int(m.group(1), 8)), f[4]) for f in fields if len(f) > 4)


def crosses_filesystem(path: Path, device: int, mounts: frozenset[str] = frozenset()) -> bool:
    """True when `path` is a mount point (os.path.ismount, or listed in `mounts`) or lives on
    another device than `device` (the bundle's)."""
    if os.path.ismount(path) or os.lstat(path).st_dev != device:
        return True
    return bool(mounts) and os.path.realpath(path) in mounts


def _refuse(target: Path, problem: str) -> UsageError:
    return UsageError(
        f"--force will not replace {str(target)!r}: {problem}",
        "remove that directory yourself (unmount anything mounted inside it first), or choose another -o",
    )


def _listed_files(target: Path) -> set[str]:
    """The old manifest's `files` keys plus manifest.json, each a canonical relative path."""
    fd = limits.open_regular(target / MANIFEST, "the old bundle's manifest")
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(limits.MAX_MANIFEST_BYTES + 1)
    try:
        files = json.loads(data).get("files")
    except (ValueError, AttributeError, RecursionError):
        files = None
    if not isinstance(files, dict) or len(data) > limits.MAX_MANIFEST_BYTES or len(files) > limits.MAX_FILES:
        raise _refuse(target, "its manifest.json has no readable list of files")
    bad = next((name for name in files if path_problem(name) is not None), None)
    if bad is not None:
        raise _refuse(target, f"its manifest lists the path {bad!r}, which is not a canonical relative path")
    return {*files, MANIFEST}


def _parents(relative: str) -> list[str]:
    parts = relative.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def plan_removal(target: Path) -> RemovalPlan:
    """Check every entry under `target` (never following a link) and list what --force deletes."""
    mounts = mount_points()
    if crosses_filesystem(target, os.lstat(target).st_dev, mounts):
        raise _refuse(target, "it is a mount point")
    listed = _listed_files(target)
    directories = {parent for name in listed for parent in _parents(name)}
    device = os.lstat(target).st_dev
    pending, seen, existing = [""], 0, []
    while pending:
        folder = pending.pop()
        with os.scandir(target / folder if folder else target) as entries:
            for entry in entries:
                relative = f"{folder}/{entry.name}" if folder else entry.name
                seen += 1
                if seen > len(listed) + len(directories):
                    raise _refuse(target, "it holds more entries than its manifest lists")
                kind = _entry_kind(target, Path(entry.path), relative, device, mounts)
                if kind == "directory" and relative in directories:
                    pending.append(relative)
                elif kind == "file" and relative in listed:
                    existing.append(relative)
                else:
                    raise _refuse(target, f"{relative!r} is not one of the bundle's listed files")
    deepest_first = sorted(directories, key=lambda name: name.count("/"), reverse=True)
    return RemovalPlan(tuple(existing), tuple(deepest_first), device, mounts)


def _entry_kind(target: Path, path: Path, relative: str, device: int, mounts: frozenset[str]) -> str:
    """'file' or 'directory' on the bundle's own filesystem; anything else is refused."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise _refuse(target, f"{relative!r} is a symbolic link")
    if crosses_filesystem(path, device, mounts):
        raise _refuse(target, f"{relative!r} is a mount point or on another filesystem")
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "file"
    raise _refuse(target, f"{relative!r} is not a regular file or directory")


def remove_planned(root: Path, plan: RemovalPlan) -> None:
    """Delete the planned files under `root` (the old bundle, renamed aside), re-checking each one
    as it goes; a directory is removed only once empty, so nothing unlisted is ever deleted."""
    mounts = plan.mounts | mount_points()  # the rename moved any mount inside: read them again
    for relative in plan.files:
        path = root / relative
        try:
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and not crosses_filesystem(path, plan.device, mounts):
                os.unlink(path)
        except OSError:
            pass
    for relative in (*plan.directories, ""):
        try:
            os.rmdir(root / relative if relative else root)
        except OSError:  # not empty (something appeared since the plan) or a mount point: left in place
            log.warning("left %s in place: it is not empty or not on the bundle's filesystem", root / relative)


def remove_tree_on_device(root: Path) -> None:
    """Remove a build's own staging directory without following links or entering another
    filesystem: a mount point inside it (and what holds it) is left in place."""
    try:
        device = os.lstat(root).st_dev
    except OSError:
        return
    if os.path.islink(root):
        return
    visited, mounts = [], mount_points()
    for folder, subfolders, names in os.walk(root):
        visited.append(folder)
        for name in [*names, *(s for s in subfolders if os.path.islink(os.path.join(folder, s)))]:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))
        subfolders[:] = [
            s
            for s in subfolders
            if os.path.isdir(os.path.join(folder, s))
            and not os.path.islink(os.path.join(folder, s))
            and not crosses_filesystem(Path(folder, s), device, mounts)
        ]
    for folder in reversed(visited):
        with contextlib.suppress(OSError):
            os.rmdir(folder)
