"""The manifest's `backends` and `files`, typed: each backend's engines (and for onnx the shared
weights file with its tensor table), and every file of the bundle with its size and sha256."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from adaptive_export.runtimes import limits
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest_fields import (
    extras,
    is_int,
    is_str_list,
    need,
    need_path,
    optional_str,
    ordered,
)
from adaptive_export.runtimes.manifest_graphs import GraphEntry

DTYPE_SIZES = {"<f4": 4, "<f2": 2, "|u1": 1, "|i1": 1, "<i8": 8, "<i4": 4, "<u2": 2}


@dataclass(frozen=True)
class TensorEntry:
    """One weight in the onnx backend's weights file: numpy dtype string, shape, byte range."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    bytes: int

    @classmethod
    def from_json(cls, name: str, meta: Any) -> TensorEntry:
        need(
            isinstance(meta, dict)
            and isinstance(meta.get("dtype"), str)
            and meta["dtype"] in DTYPE_SIZES
            and is_int(meta.get("offset"))
            and meta["offset"] >= 0
            and is_int(meta.get("bytes"))
            and meta["bytes"] >= 0
            and isinstance(meta.get("shape"), list)
            and len(meta["shape"]) <= 8
            and all(is_int(d) and d >= 0 for d in meta["shape"]),
            f"weight table entry {name!r} is malformed",
        )
        need(
            math.prod(meta["shape"]) * DTYPE_SIZES[meta["dtype"]] == meta["bytes"],
            f"weight table entry {name!r}: shape {meta['shape']} of {meta['dtype']} is not {meta['bytes']} bytes",
        )
        return cls(meta["dtype"], tuple(meta["shape"]), meta["offset"], meta["bytes"])

    def to_json(self) -> dict[str, object]:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset, "bytes": self.bytes}


@dataclass(frozen=True)
class EngineEntry:
    """A backend's engine for one graph: its file (onnx), the ONNX file it is built from
    (tensorrt), the weights the runtime supplies from the weights file (onnx); other keys
    (coreml's function and I/O) in `extra`."""

    file: str | None = None
    onnx: str | None = None
    initializers: tuple[str, ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, backend: str, graph: str, obj: Any) -> EngineEntry:
        need(isinstance(obj, dict), f"backend {backend!r} engine {graph!r} is not an object")
        need(isinstance(obj.get("file", ""), str), f"backend {backend!r} engine {graph!r} has a non-string file")
        need(
            is_str_list(obj.get("initializers", [])),
            f"backend {backend!r} engine {graph!r} has a bad initializer list",
        )
        need(isinstance(obj.get("onnx", ""), str), f"backend {backend!r} engine {graph!r} has a non-string onnx file")
        initializers = obj.get("initializers")
        return cls(
            obj.get("file"),
            obj.get("onnx"),
            None if initializers is None else tuple(initializers),
            extras(obj, ("file", "onnx", "initializers")),
            tuple(obj),
        )

    def files(self) -> list[str]:
        return [path for path in (self.file, self.onnx) if path is not None]

    def to_json(self) -> dict[str, object]:
        values: dict[str, object] = {"file": self.file, "onnx": self.onnx, "initializers": self.initializers}
        values = {key: list(v) if isinstance(v, tuple) else v for key, v in values.items() if v is not None}
        return ordered({**values, **self.extra}, self.key_order or ("file", "initializers"))


_BACKEND_KEYS = ("graphs", "weights", "weight_bytes", "tensors", "flavour", "quantize", "precision", "package")
_COMPILED_KEYS = tuple(key for key in _BACKEND_KEYS if key not in ("weight_bytes", "tensors"))  # not onnx


@dataclass(frozen=True)
class BackendEntry:
    """One backend's part of the bundle: its engine per graph, and for onnx the shared weights
    file with its tensor table. `flavour` and `quantize` describe the onnx engines,
    `precision` a compiled backend's, `package` CoreML's multifunction model."""

    name: str
    graphs: Mapping[str, EngineEntry]
    weights: str | None = None
    weight_bytes: int = 0  # onnx: the weights file's size
    tensors: Mapping[str, TensorEntry] = field(default_factory=dict)  # onnx: the weights file's table
    flavour: str = "portable"
    quantize: str = "none"
    precision: str | None = None
    package: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    key_order: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, name: str, obj: Any, graphs: Mapping[str, GraphEntry]) -> BackendEntry:
        need(isinstance(obj, dict) and isinstance(obj.get("graphs"), dict), f"backend {name!r} lacks a graphs table")
        engines = {}
        for graph_name, engine in obj["graphs"].items():
            need(graph_name in graphs, f"backend {name!r} has an engine for unknown graph {graph_name!r}")
            engines[graph_name] = EngineEntry.from_json(name, graph_name, engine)
        for key in ("flavour", "quantize", "precision", "package"):
            optional_str(obj, key, f"backends.{name}.{key} must be a string")
        weights = obj.get("weights")
        entry = cls(
            name, engines, weights if isinstance(weights, str) else None, 0, {},
            obj.get("flavour", "portable"), obj.get("quantize", "none"), obj.get("precision"), obj.get("package"),
            extras(obj, _BACKEND_KEYS if name == "onnx" else _COMPILED_KEYS), tuple(obj),
        )  # fmt: skip
        if name == "onnx":
            return entry._checked_onnx(obj)
        if weights is not None and not isinstance(weights, str):  # kept as it was written (not a path)
            return replace(entry, extra={**entry.extra, "weights": weights})
        return entry

    def _checked_onnx(self, obj: Mapping[str, Any]) -> BackendEntry:
        """The onnx backend: a weights file, its tensor table, every engine's file and initializers."""
        need(isinstance(obj.get("weights"), str), "backends.onnx.weights must be a path")
        need(
            is_int(obj.get("weight_bytes", 0)) and obj.get("weight_bytes", 0) >= 0,
            "backends.onnx.weight_bytes must be a byte count",
        )
        table = obj.get("tensors")
        need(isinstance(table, dict) and len(table) <= limits.MAX_TENSORS, "backends.onnx.tensors must be an object")
        tensors = {name: TensorEntry.from_json(name, meta) for name, meta in dict(table or {}).items()}
        for graph_name, engine in self.graphs.items():
            need(engine.file is not None, f"onnx engine {graph_name!r} lacks its file")
            need(engine.initializers is not None, f"onnx engine {graph_name!r} lacks its initializer list")
            need(
                all(n in tensors for n in engine.initializers or ()),
                f"onnx engine {graph_name!r} uses a weight missing from the table",
            )
        return replace(self, tensors=tensors, weight_bytes=obj.get("weight_bytes", 0))

    @property
    def accuracy_level(self) -> int | None:
        """MatMulNBits' accuracy level of the onnx engines (`quant_options.accuracy_level`), if quantized."""
        options = self.extra.get("quant_options")
        level = options.get("accuracy_level") if isinstance(options, Mapping) else None
        return level if isinstance(level, int) and is_int(level) else None

    @property
    def native_form(self) -> str | None:
        """How a `--quantize native` bundle holds the GGUF's blocks, as its build recorded it
        (`quant_options.native_form`): "packed" (the rows as stored) or "nbits" (MatMulNBits, the
        default, unrecorded); None when the weights are not native. Informational: the runtime decides
        what an engine needs from the engine itself (runtimes/graph_policy.py)."""
        if self.quantize != "native":
            return None
        options = self.extra.get("quant_options")
        form = options.get("native_form") if isinstance(options, Mapping) else None
        return "packed" if form == "packed" else "nbits"

    def engine(self, graph: str) -> EngineEntry:
        engine = self.graphs.get(graph)
        if engine is None:
            raise UsageError(f"the {self.name} backend has no engine for graph {graph!r}", "rebuild the bundle")
        return engine

    def to_json(self) -> dict[str, object]:
        values: dict[str, object] = {"weights": self.weights, "precision": self.precision, "package": self.package}
        values = {key: value for key, value in values.items() if value is not None}
        if self.name == "onnx":
            values["weight_bytes"] = self.weight_bytes
            values["tensors"] = {name: tensor.to_json() for name, tensor in self.tensors.items()}
        if "flavour" in self.key_order or self.flavour != "portable":
            values["flavour"] = self.flavour
        if "quantize" in self.key_order or self.quantize != "none":
            values["quantize"] = self.quantize
        values["graphs"] = {name: engine.to_json() for name, engine in self.graphs.items()}
        return ordered({**values, **self.extra}, self.key_order)


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    bytes: int

    @classmethod
    def from_json(cls, path: Any, obj: Any) -> FileEntry:
        need_path(path, f"in 'files' ({ascii(path)})")
        need(path != "manifest.json", "'files' lists manifest.json itself")
        need(
            isinstance(obj, dict)
            and isinstance(obj.get("sha256"), str)
            and len(obj["sha256"]) == 64
            and all(c in "0123456789abcdef" for c in obj["sha256"])
            and is_int(obj.get("bytes"))
            and obj["bytes"] >= 0,
            f"files entry {ascii(path)} lacks a sha256 hex digest or a byte count",
        )
        return cls(obj["sha256"], obj["bytes"])

    def to_json(self) -> dict[str, object]:
        return {"sha256": self.sha256, "bytes": self.bytes}
