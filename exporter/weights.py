"""Store every weight once for all graphs of a bundle.

Each large initializer of each exported graph is keyed by its content (sha256 of the
bytes, dtype and shape). The first time a tensor is seen it is appended to one shared
file and named after the model parameter with the same bytes (stable across graphs and
builds); graphs then refer to it as ONNX external data by name, offset and length.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Initializers below this size (shape vectors, scalars) stay inside each graph.
MIN_SHARED_BYTES = 1024
ALIGNMENT = 64  # keeps every tensor aligned for zero-copy numpy views and SIMD loads


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int


def content_key(array: np.ndarray) -> str:
    digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()
    return f"{array.dtype.str}:{array.shape}:{digest}"


@dataclass
class WeightStore:
    """Append-only writer of the shared weights file, deduplicating by content."""

    path: Path
    canonical_names: dict[str, str] = field(default_factory=dict)  # content key -> parameter name
    tensors: dict[str, StoredTensor] = field(default_factory=dict)  # content key -> stored
    _file: BinaryIO | None = None
    _offset: int = 0
    _names: set[str] = field(default_factory=set)

    def __enter__(self) -> WeightStore:
        self._file = self.path.open("wb")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._file is not None
        self._file.close()

    def name_parameters(self, named: Iterable[tuple[str, np.ndarray]]) -> None:
        """Remember the model's own names so shared tensors are named after their parameter."""
        for name, array in named:
            self.canonical_names.setdefault(content_key(array), name)

    def add(self, array: np.ndarray, preferred: str = "") -> StoredTensor:
        return self.add_bytes(np.ascontiguousarray(array).tobytes(), array.dtype.str, tuple(array.shape), preferred)

    def add_bytes(self, data: bytes, dtype: str, shape: tuple[int, ...], preferred: str = "") -> StoredTensor:
        """`add` for a tensor already serialized (an initializer's raw_data): no copy of its bytes."""
        key = f"{dtype}:{shape}:{hashlib.sha256(data).hexdigest()}"
        stored = self.tensors.get(key)
        if stored is not None:
            return stored
        assert self._file is not None, "WeightStore must be used as a context manager"
        padding = (-self._offset) % ALIGNMENT
        self._file.write(b"\0" * padding)
        self._offset += padding
        name = self.canonical_names.get(key) or preferred or f"const.{key.rsplit(':', 1)[1][:16]}"
        if name in self._names:  # same name, other content (e.g. two quantizations): keep both
            name = f"{name}.{key.rsplit(':', 1)[1][:12]}"
        self._names.add(name)
        stored = StoredTensor(name, dtype, shape, self._offset, len(data))
        self._file.write(data)
        self._offset += len(data)
        self.tensors[key] = stored
        return stored

    @property
    def total_bytes(self) -> int:
        return self._offset


def rename_initializers(model: onnx.ModelProto, renames: dict[str, str]) -> None:
    """Rename initializers (and their uses) from their original names, in one pass. A store name
    is the name its bytes had in the first graph that stored them (a traced name such as
    'add_570' where no parameter owns them), which another graph may use for a computed value:
    that value is renamed out of the way first (an engine defining a name twice does not load)."""
    _move_values_aside(model, set(renames.values()) - set(renames))
    for init in model.graph.initializer:
        init.name = renames.get(init.name, init.name)
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            if name in renames:
                node.input[index] = renames[name]
    _dedupe_initializers(model)


def _move_values_aside(model: onnx.ModelProto, names: set[str]) -> None:
    """Give each node output in `names` a fresh name, in every node that reads it."""
    graph = model.graph
    taken = {n for n in names if any(n in node.output for node in graph.node)}
    if not taken:
        return
    outputs = taken & {o.name for o in graph.output}
    if outputs:
        raise ValueError(f"graph output(s) {sorted(outputs)} collide with stored tensors' names")
    used = {i.name for i in graph.initializer} | {i.name for i in graph.input}
    used |= {name for node in graph.node for name in (*node.input, *node.output)}
    fresh: dict[str, str] = {}
    for name in sorted(taken):
        candidate, index = f"{name}_value", 1
        while candidate in used:
            candidate, index = f"{name}_value{index}", index + 1
        fresh[name] = candidate
        used.add(candidate)
    for node in graph.node:
        for names_of_node in (node.input, node.output):
            for index, name in enumerate(names_of_node):
                if name in fresh:
                    names_of_node[index] = fresh[name]
    for info in graph.value_info:
        info.name = fresh.get(info.name, info.name)


def canonicalize_names(model: onnx.ModelProto, store: WeightStore) -> None:
    """Name every large initializer after the model parameter with the same bytes, so
    later passes (quantization) derive stable names (`<param>.T_Q4`) in every graph."""
    renames = {}
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            continue  # the lean build's placeholders are named after their parameter already
        array = numpy_helper.to_array(init)
        if array.nbytes >= MIN_SHARED_BYTES:
            name = store.canonical_names.get(content_key(array))
            if name and name != init.name:
                renames[init.name] = name
    rename_initializers(model, renames)


ReadPlaceholder = Callable[[onnx.TensorProto], np.ndarray]


def externalize(model: onnx.ModelProto, store: WeightStore, location: str, lazy: ReadPlaceholder | None = None) -> None:
    """Move the graph's large initializers into the store and point the graph at them (the lean
    build's placeholders read through `lazy`, one at a time)."""
    renames: dict[str, str] = {}
    for init in model.graph.initializer:
        if _stored_in(init, location):
            continue
        array = _initializer_array(init, lazy)
        if array.nbytes < MIN_SHARED_BYTES:
            continue
        stored = store.add(array, init.name)
        del array
        if init.name != stored.name:
            renames[init.name] = stored.name
        _point_at(init, stored, location)
    # one rename of every initializer and node input, from the original names: renaming in the
    # loop above and again here renamed a tensor twice where one graph's names are another's
    # shifted (Gemma 3's skip configuration: 'add_109' -> 'add_95' -> 'add_81'), so an engine
    # named a tensor after another's bytes
    rename_initializers(model, renames)


def _point_at(init: onnx.TensorProto, stored: StoredTensor, location: str) -> None:
    """Make `init` external data at the stored tensor's place in the weights file."""
    init.ClearField("raw_data")
    for fld in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        init.ClearField(fld)
    init.data_location = onnx.TensorProto.EXTERNAL
    del init.external_data[:]
    for key, value in (("location", location), ("offset", str(stored.offset)), ("length", str(stored.length))):
        entry = init.external_data.add()
        entry.key, entry.value = key, value


def _stored_in(init: onnx.TensorProto, location: str) -> bool:
    return init.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == location for e in init.external_data
    )


def externalize_tensor(init: onnx.TensorProto, store: WeightStore, location: str) -> onnx.TensorProto:
    """One initializer into the store now, under its own name (the lean build writes each linear's
    blocks as they are made); returns a new external TensorProto to use instead, which the graph's
    later `externalize` leaves. New, not cleared: protobuf keeps a cleared field's bytes in the
    message's arena until the message goes, so a cleared tensor would still hold its weights."""
    raw = init.raw_data  # protobuf hands out a copy at each access: take it once
    if len(raw) < MIN_SHARED_BYTES:
        return init
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)).str
    stored = store.add_bytes(raw, dtype, tuple(init.dims), init.name)
    del raw
    external = onnx.TensorProto(name=init.name, data_type=init.data_type, dims=init.dims)
    _point_at(external, stored, location)
    return external


def _initializer_array(init: onnx.TensorProto, lazy: ReadPlaceholder | None) -> np.ndarray:
    if init.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(init)
    if lazy is None:
        raise ValueError(f"initializer {init.name!r} is external, and no reader for it was given")
    return lazy(init)


def _dedupe_initializers(model: onnx.ModelProto) -> None:
    """Two initializers with equal content now share one name: keep a single entry."""
    seen: set[str] = set()
    keep = []
    for init in model.graph.initializer:
        if init.name not in seen:
            seen.add(init.name)
            keep.append(init)
    if len(keep) != len(model.graph.initializer):
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)
