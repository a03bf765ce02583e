"""Routers and exit adapters as safetensors files, and the PyTorch reference of a bundle.

safetensors holds raw tensors only (no pickle), so loading them never executes code.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from graphs.adaptive import ExitAdapter, Routers
from graphs.span_graph import ModelParts
from runtimes.bundle import Bundle
from runtimes.errors import UsageError

ROUTERS_FILE = "routers.safetensors"
ADAPTERS_FILE = "exit_adapters.safetensors"


def routers_bytes(routers: Routers) -> bytes:
    from safetensors.torch import save

    return save({"weight": routers.weight.detach().contiguous()})


def load_routers(path: str | Path, num_layers: int, hidden_size: int) -> Routers:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise UsageError(f"routers file {str(path)!r} does not exist", "pass --routers train, or a .safetensors file written by a previous build")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise UsageError(f"routers file {str(path)!r} is not a readable safetensors file ({exc})", "pass --routers train to train new routers") from exc
    weight = tensors.get("weight")
    if weight is None or tuple(weight.shape) != (num_layers, hidden_size):
        shape = None if weight is None else tuple(weight.shape)
        raise UsageError(f"routers file {str(path)!r} holds weight of shape {shape}, this model needs ({num_layers}, {hidden_size})",
                         "train routers for this model with --routers train")
    routers = Routers(num_layers, hidden_size)
    routers.weight.data.copy_(weight.float())
    return routers


def adapters_bytes(adapters: dict[int, ExitAdapter]) -> bytes:
    from safetensors.torch import save

    tensors = {f"{layer}.{name}": p.detach().contiguous() for layer, a in adapters.items() for name, p in a.named_parameters()}
    return save(tensors)


def load_adapters(path: Path, hidden_size: int, eps: float) -> dict[int, ExitAdapter]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    adapters: dict[int, ExitAdapter] = {}
    for layer in sorted({int(k.split(".", 1)[0]) for k in tensors}):
        rank = tensors[f"{layer}.down.weight"].shape[0]
        adapter = ExitAdapter(hidden_size, rank, eps)
        adapter.load_state_dict({k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"{layer}.")})
        adapters[layer] = adapter.eval()
    return adapters


def load_parts(bundle: Bundle, model: str | None) -> tuple[Any, ModelParts]:
    """The HF model the bundle was built from (or `model`), plus the bundle's routers and adapters."""
    from exporter.model_loading import load_model

    loaded = load_model(model or bundle.model.get("source") or "smollm2")
    if loaded.spec.to_json() != {k: bundle.model[k] for k in loaded.spec.to_json()}:
        raise UsageError(f"model {loaded.source!r} does not match the bundle's dimensions", "pass the model the bundle was built from with --model")
    parts = ModelParts(loaded.hf_model, loaded.spec)
    if (bundle.root / ROUTERS_FILE).is_file():
        parts.routers = load_routers(bundle.path(ROUTERS_FILE), loaded.spec.num_layers, loaded.spec.hidden_size)
    if (bundle.root / ADAPTERS_FILE).is_file():
        parts.exit_adapters = load_adapters(bundle.path(ADAPTERS_FILE), loaded.spec.hidden_size, loaded.spec.rms_norm_eps)
    return loaded, parts
