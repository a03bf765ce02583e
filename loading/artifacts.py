"""Routers and exit adapters as safetensors files, and the PyTorch reference of a bundle.

safetensors holds raw tensors only (no pickle), so loading them never executes code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from adaptive_export.graphs.adaptive import DraftHead, ExitAdapter, GatedExitAdapter, Routers
from adaptive_export.graphs.span_graph import ModelParts
from adaptive_export.loading.warning_filters import library_call_warnings_hidden
from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.draft_contracts import TableArtifact
from adaptive_export.runtimes.drafting import SOURCES
from adaptive_export.runtimes.errors import UsageError

ROUTERS_FILE = "routers.safetensors"
ADAPTERS_FILE = "exit_adapters.safetensors"
SKIP_ADAPTERS_FILE = "skip_adapters.safetensors"


def routers_bytes(routers: Routers) -> bytes:
    from safetensors.torch import save

    return save({"weight": routers.weight.detach().contiguous()})


def _read_tensors(path: str | Path, what: str, missing_fix: str, unreadable_fix: str) -> dict[str, Any]:
    """A user's safetensors file by name: `what` names it in the error when it is missing or unreadable."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise UsageError(f"{what} {str(path)!r} does not exist", missing_fix)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise UsageError(f"{what} {str(path)!r} is not a readable safetensors file ({exc})", unreadable_fix) from exc


def load_routers(path: str | Path, num_layers: int, hidden_size: int) -> Routers:
    tensors = _read_tensors(
        path,
        "routers file",
        "pass --routers train, or a .safetensors file written by a previous build",
        "pass --routers train to train new routers",
    )
    weight = tensors.get("weight")
    if weight is None or tuple(weight.shape) != (num_layers, hidden_size):
        shape = None if weight is None else tuple(weight.shape)
        raise UsageError(
            f"routers file {str(path)!r} holds weight of shape {shape}, this model needs ({num_layers}, {hidden_size})",
            "train routers for this model with --routers train",
        )
    routers = Routers(num_layers, hidden_size)
    routers.weight.data.copy_(weight.float())
    return routers


def adapters_bytes(adapters: dict[int, ExitAdapter] | dict[int, Any]) -> bytes:
    from safetensors.torch import save

    tensors = {
        f"{layer}.{name}": p.detach().contiguous() for layer, a in adapters.items() for name, p in a.named_parameters()
    }
    return save(tensors)


def load_adapters(
    path: str | Path, hidden_size: int, eps: float, num_layers: int
) -> dict[int, ExitAdapter | GatedExitAdapter]:
    """Exit adapters keyed '<E>.norm_weight', '<E>.down.weight', '<E>.up.weight', checked against the model."""
    fix = "fit adapters for this model with --exit-adapter fit"
    missing = "pass --exit-adapter fit, or an exit_adapters.safetensors file written by a previous build"
    tensors = _read_tensors(path, "exit adapter file", missing, fix)
    layers = sorted({int(k.split(".", 1)[0]) for k in tensors if k.split(".", 1)[0].isdigit()})
    if not layers:
        raise UsageError(f"exit adapter file {str(path)!r} holds no '<E>.down.weight' tensors", fix)
    adapters: dict[int, ExitAdapter | GatedExitAdapter] = {}
    for layer in layers:
        if not 0 < layer < num_layers:
            raise UsageError(
                f"exit adapter file {str(path)!r} has an adapter for layer {layer}, "
                f"this model has exits 1..{num_layers - 1}",
                fix,
            )
        own = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"{layer}.")}
        adapters[layer] = adapter_from_tensors(own, hidden_size, eps, f"exit adapter file {str(path)!r}", layer)
    return adapters


def load_skip_adapters(path: str | Path, hidden_size: int, eps: float, num_layers: int) -> dict[int, ExitAdapter]:
    """A bundle's skip adapters (`build --lora R`): low-rank blocks keyed '<layer>.norm_weight',
    '<layer>.down.weight', '<layer>.up.weight' for layers 0..num_layers-1, checked against the model."""
    fix = "rebuild the bundle with --routers train --lora R"
    tensors = _read_tensors(path, "skip adapter file", fix, fix)
    what = f"skip adapter file {str(path)!r}"
    by_layer: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        layer, _, name = key.partition(".")
        if not layer.isdigit() or not 0 <= int(layer) < num_layers:
            raise UsageError(f"{what} holds {key[:80]!r}, not a tensor of layers 0..{num_layers - 1}", fix)
        by_layer.setdefault(int(layer), {})[name] = tensor
    adapters = {layer: adapter_from_tensors(own, hidden_size, eps, what, layer) for layer, own in by_layer.items()}
    if any(not isinstance(a, ExitAdapter) for a in adapters.values()):
        raise UsageError(f"{what} holds a gated block; skip adapters are low-rank", fix)
    return adapters  # type: ignore[return-value]


def _check_skip_adapters_cover(bundle: Bundle, parts: ModelParts) -> None:
    """Every graph that adapts its layers has their adapters in the bundle's listed file (the
    reference cannot be built otherwise)."""
    for graph in bundle.manifest.graphs:
        entry = bundle.graph(graph)
        missing = sorted(set(entry.layers) - set(parts.skip_adapters)) if entry.skip_adapters else []
        if missing:
            raise UsageError(
                f"graph {graph!r} adapts layers {missing[:8]}, and the bundle's {SKIP_ADAPTERS_FILE} holds "
                "no adapter for them",
                "rebuild the bundle with --routers ... --lora R",
            )


def adapter_from_tensors(
    own: dict[str, Any], hidden_size: int, eps: float, what: str, layer: int
) -> ExitAdapter | GatedExitAdapter:
    """One exit block from its tensors: low-rank (norm_weight, down, up) or gated (norm_weight,
    gate, up, down; `build --draft-head`), every shape checked against the model."""
    gated = "gate.weight" in own
    width_of = own.get("gate.weight" if gated else "down.weight")
    width = int(width_of.shape[0]) if width_of is not None and width_of.dim() == 2 else 0
    if gated:
        expected = {
            "norm_weight": (hidden_size,),
            "gate.weight": (width, hidden_size),
            "up.weight": (width, hidden_size),
            "down.weight": (hidden_size, width),
        }
    else:
        expected = {
            "norm_weight": (hidden_size,),
            "down.weight": (width, hidden_size),
            "up.weight": (hidden_size, width),
        }
    shapes = {k: tuple(v.shape) for k, v in own.items()}
    if width == 0 or width > 16 * hidden_size or shapes != expected:
        raise UsageError(
            f"{what} holds tensors {shapes} for layer {layer}, this model needs norm_weight ({hidden_size},), "
            f"down.weight (rank, {hidden_size}), up.weight ({hidden_size}, rank) [low-rank] or norm_weight, "
            f"gate.weight and up.weight (width, {hidden_size}), down.weight ({hidden_size}, width) [gated]",
            "fit adapters for this model with --exit-adapter fit, or train a draft head with --draft-head train",
        )
    block = GatedExitAdapter(hidden_size, width, eps) if gated else ExitAdapter(hidden_size, width, eps)
    block.load_state_dict({k: v.float() for k, v in own.items()})
    return block.eval()


def draft_head_bytes(head: DraftHead) -> bytes:
    """A trained draft head as one fp16 safetensors file: '<E>.*' block tensors, 'ids' (int32), and
    its form, draft length and stop threshold as metadata (the LM head rows are the model's own)."""
    import torch
    from safetensors.torch import save

    tensors = {f"{head.exit_layer}.{n}": p.detach().half().contiguous() for n, p in head.block.named_parameters()}
    tensors["ids"] = head.ids.to(torch.int32).contiguous()
    metadata = {"form": head.form, "draft_len": str(head.draft_len), "stop_below": repr(float(head.stop_below))}
    return save(tensors, metadata=metadata)


def load_draft_head(path: str | Path, hidden_size: int, eps: float, num_layers: int, vocab_size: int) -> DraftHead:
    """`build --draft-head FILE`: a file draft_head_bytes wrote, checked against the model."""
    from safetensors import SafetensorError, safe_open

    fix = "train a draft head for this model with --draft-head train"
    try:
        with safe_open(str(path), framework="pt") as reader:
            metadata = reader.metadata() or {}
            tensors = {k: reader.get_tensor(k) for k in reader.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise UsageError(f"draft head file {str(path)!r} is not a readable safetensors file ({exc})", fix) from exc
    ids = tensors.pop("ids", None)
    layers = {k.split(".", 1)[0] for k in tensors}
    try:
        draft_len, stop_below = int(metadata["draft_len"]), float(metadata["stop_below"])
        (layer_text,) = layers
        layer = int(layer_text)
    except (KeyError, ValueError):
        raise UsageError(f"draft head file {str(path)!r} lacks one exit's tensors, ids or metadata", fix) from None
    good_ids = ids is not None and ids.dim() == 1 and 0 < ids.numel() < vocab_size
    if not good_ids or not bool((ids[1:] > ids[:-1]).all()) or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise UsageError(f"draft head file {str(path)!r} holds no ascending token ids below {vocab_size}", fix)
    if not 0 < layer < num_layers or not 1 <= draft_len <= 16 or not 0.0 <= stop_below < 1.0:
        raise UsageError(
            f"draft head file {str(path)!r} has exit {layer}, draft length {draft_len}, threshold {stop_below}: "
            f"this model needs an exit in 1..{num_layers - 1}, a length in 1..16 and a threshold in [0, 1)",
            fix,
        )
    own = {k.split(".", 1)[1]: v for k, v in tensors.items()}
    block = adapter_from_tensors(own, hidden_size, eps, f"draft head file {str(path)!r}", layer)
    form = "gated" if isinstance(block, GatedExitAdapter) else "lowrank"
    return DraftHead(layer, form, block, ids.long(), draft_len, stop_below)


def draft_table_bytes(artifact: TableArtifact, table: Any) -> bytes:
    """A draft source's trained table as its bundle file (runtimes/drafting/<name>.py declares it)."""
    from safetensors.torch import save

    return save({artifact.key: table.detach().contiguous()})


def load_draft_table(artifact: TableArtifact, path: str | Path, hidden_size: int) -> Any:
    """A draft source's trained table [1..max_rows, hidden], checked against the model."""
    missing = f"{artifact.fix}, or pass a {artifact.file} file written by a previous build"
    tensors = _read_tensors(path, f"{artifact.what} file", missing, artifact.fix)
    table = tensors.get(artifact.key)
    if (
        table is None
        or table.dim() != 2
        or table.shape[1] != hidden_size
        or not 1 <= table.shape[0] <= artifact.max_rows
    ):
        shape = None if table is None else tuple(table.shape)
        raise UsageError(
            f"{artifact.what} file {str(path)!r} holds {artifact.key} of shape {shape}, this model needs "
            f"(1..{artifact.max_rows}, {hidden_size})",
            artifact.fix,
        )
    return table.float()


def reference_hint(bundle: Bundle) -> str:
    """The manifest's model source as a hint for the user: escaped and bounded, never opened."""
    from adaptive_export.loading.packaged import PACKAGED

    source = bundle.model.source
    if not source:
        return "the bundle records no model"
    shown = ascii(source) if len(source) <= 160 else ascii(source[:157]) + "..."
    relative = source not in PACKAGED and not Path(source).is_absolute()
    return f"the bundle records {shown}{', a relative path' if relative else ''}"


def load_parts(bundle: Bundle, model: str | None) -> tuple[Any, ModelParts]:
    """The reference model the user named (`model`), plus the bundle's routers and adapters.

    The manifest's `model.source` is never opened: a bundle could point it at a tampered
    reference inside itself, or at any file outside (docs/hardening.md, "check as a CI gate")."""
    from adaptive_export.loading.model import load_model

    if model is None:
        raise UsageError(
            "check needs the reference model", f"pass --model <the model you built from> ({reference_hint(bundle)})"
        )
    with library_call_warnings_hidden():  # transformers' deprecation notices while loading are not our output
        loaded = load_model(model)
    check_reference_dims(bundle, loaded)
    parts = ModelParts(loaded.hf_model, loaded.spec)
    add_trained_parts(bundle, parts)
    return loaded, parts


def check_reference_dims(bundle: Bundle, loaded: Any) -> None:
    """The reference the user named has the bundle's dimensions, or one error line."""
    recorded_dims = bundle.model.to_json()
    if loaded.spec.to_json() != {k: recorded_dims.get(k) for k in loaded.spec.to_json()}:
        raise UsageError(
            f"model {loaded.source!r} does not match the bundle's dimensions",
            "pass the model the bundle was built from with --model",
        )


def add_trained_parts(bundle: Bundle, parts: ModelParts) -> None:
    """The bundle's own trained parts (routers, skip and exit adapters, draft tables, the draft
    vocabulary) into `parts`: what no model defines, read from the bundle's listed files only."""
    spec = parts.spec
    if ROUTERS_FILE in bundle.manifest.files:  # only listed (checksummed) files are opened
        parts.routers = load_routers(bundle.path(ROUTERS_FILE), spec.num_layers, spec.hidden_size)
    if SKIP_ADAPTERS_FILE in bundle.manifest.files:
        parts.skip_adapters = load_skip_adapters(
            bundle.path(SKIP_ADAPTERS_FILE), spec.hidden_size, spec.rms_norm_eps, spec.num_layers
        )
    _check_skip_adapters_cover(bundle, parts)
    if ADAPTERS_FILE in bundle.manifest.files:
        parts.exit_adapters = load_adapters(
            bundle.path(ADAPTERS_FILE), spec.hidden_size, spec.rms_norm_eps, spec.num_layers
        )
    for name, source in SOURCES.items():  # a draft source's trained table, when the bundle ships one
        if source.table is not None and source.table.file in bundle.manifest.files:
            parts.draft_tables[name] = load_draft_table(source.table, bundle.path(source.table.file), spec.hidden_size)
    if bundle.draft_vocab_ids is not None:
        import torch

        parts.draft_vocab = torch.from_numpy(bundle.draft_vocab_ids.astype(np.int64))  # as the build holds them
