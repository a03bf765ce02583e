"""Traced graphs kept on disk, so the same model's plain graphs are traced once per machine.

torch.export is most of a build's and of `check`'s structural rebuild's time (the portable
flavour: about 40 s per engine of SmolLM2 on a 2-core Zen 3). What a memory-lean trace returns
(exporter/lean_export.py) is a function of what the trace reads: the code that builds the graph,
the library versions, the GraphSpec, the model's config, and the names, shapes and dtypes of its
fake weights plus the bytes of its real ones (norms, biases, rotary tables). The key hashes all of
that, so an entry is reused only where a fresh trace would return the same graph; `build` writes
entries and a `check` on the same machine reads them (a check elsewhere traces, cold).

Only graphs without trained additions are kept (routers, adapters, drafts: their tensors live
outside the model, and those graphs are not what `check` rebuilds). The folder is the user's own
cache, like the assembled .gguf files beside it; an unreadable entry is traced again.
ADAPTIVE_EXPORT_GRAPH_CACHE=off turns it off, or names another folder.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from adaptive_export.graphs.span_graph import GraphSpec, ModelParts
from adaptive_export.loading.lean_model import is_fake

CACHE_BYTES = 512 << 20  # the oldest entries go beyond this
_TRACED_PACKAGES = ("graphs", "exporter", "loading")  # the code a trace runs (ours)
_LIBRARIES = ("torch", "onnx", "onnxscript", "onnx-ir", "transformers")


@dataclass(frozen=True)
class GraphCache:
    folder: Path

    def get(self, key: str) -> onnx.ModelProto | None:
        path = self.folder / f"{key}.onnx"
        try:
            model = onnx.load(str(path), load_external_data=False)
        except (OSError, ValueError, DecodeError):
            return None  # missing or unreadable: trace again
        os.utime(path)  # recently used: evicted last
        return model

    def put(self, key: str, model: onnx.ModelProto) -> None:
        """Write atomically (a temp file, then a rename), then keep the folder under CACHE_BYTES."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.folder, suffix=".partial", delete=False) as out:
                out.write(model.SerializeToString())
            os.replace(out.name, self.folder / f"{key}.onnx")
            self._evict()
        except OSError:
            return  # a cache that cannot be written only costs the next trace

    def _evict(self) -> None:
        entries = sorted(self.folder.glob("*.onnx"), key=lambda p: p.stat().st_mtime, reverse=True)
        total = 0
        for path in entries:
            total += path.stat().st_size
            if total > CACHE_BYTES:
                path.unlink(missing_ok=True)


def graph_cache() -> GraphCache | None:
    """The cache folder: $ADAPTIVE_EXPORT_GRAPH_CACHE (or None for "off"), else graphs/ in the
    package's cache folder."""
    from adaptive_export.loading.packaged import cache_dir

    setting = os.environ.get("ADAPTIVE_EXPORT_GRAPH_CACHE", "")
    if setting.lower() in ("off", "0", "no", "false"):
        return None
    return GraphCache(Path(setting) if setting else cache_dir() / "graphs")


def cacheable(graph: GraphSpec) -> bool:
    """Whether the graph reads nothing but the model (no routers, adapters or draft tables)."""
    return not (
        graph.router_scores or graph.exit_adapter or graph.skip_adapters or graph.draft_fields or graph.draft_vocab
    )


def trace_key(parts: ModelParts, graph: GraphSpec, max_len: int | None) -> str:
    """sha256 of everything the lean trace of `graph` reads (see the module docstring)."""
    import torch

    digest = hashlib.sha256()
    for text in (_code_digest(), repr(graph), repr(max_len), parts.hf_model.config.to_json_string()):
        digest.update(text.encode() + b"\0")
    named = [*parts.hf_model.named_parameters(remove_duplicate=False), *parts.hf_model.named_buffers()]
    for name, tensor in named:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}\0".encode())
        if not is_fake(tensor):
            digest.update(tensor.detach().to(torch.float64).contiguous().numpy().tobytes())
    return digest.hexdigest()


@functools.cache
def _code_digest() -> str:
    """Our tracing code's source and the libraries' versions: any change misses the cache."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for package in _TRACED_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    for library in _LIBRARIES:
        try:
            digest.update(f"{library}={importlib.metadata.version(library)}\0".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{library}=none\0".encode())
    return digest.hexdigest()
