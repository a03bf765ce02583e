"""Routers and exit adapters as safetensors files, and the PyTorch reference of a bundle.

safetensors holds raw tensors only (no pickle), so loading them never executes code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adaptive_export.graphs.adaptive import ExitAdapter, Routers
from adaptive_export.graphs.span_graph import ModelParts
from adaptive_export.loading.warning_filters import library_call_warnings_hidden
from adaptive_export.runtimes.bundle import Bundle
from adaptive_export.runtimes.errors import UsageError

ROUTERS_FILE = "routers.safetensors"
ADAPTERS_FILE = "exit_adapters.safetensors"
PROMPT_TOKENS_FILE = "prompt_tokens.safetensors"


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


def adapters_bytes(adapters: dict[int, ExitAdapter]) -> bytes:
    from safetensors.torch import save

    tensors = {
        f"{layer}.{name}": p.detach().contiguous() for layer, a in adapters.items() for name, p in a.named_parameters()
    }
    return save(tensors)


def load_adapters(path: str | Path, hidden_size: int, eps: float, num_layers: int) -> dict[int, ExitAdapter]:
    """Exit adapters keyed '<E>.norm_weight', '<E>.down.weight', '<E>.up.weight', checked against the model."""
    fix = "fit adapters for this model with --exit-adapter fit"
    missing = "pass --exit-adapter fit, or an exit_adapters.safetensors file written by a previous build"
    tensors = _read_tensors(path, "exit adapter file", missing, fix)
    layers = sorted({int(k.split(".", 1)[0]) for k in tensors if k.split(".", 1)[0].isdigit()})
    if not layers:
        raise UsageError(f"exit adapter file {str(path)!r} holds no '<E>.down.weight' tensors", fix)
    adapters: dict[int, ExitAdapter] = {}
    for layer in layers:
        if not 0 < layer < num_layers:
            raise UsageError(
                f"exit adapter file {str(path)!r} has an adapter for layer {layer}, "
                f"this model has exits 1..{num_layers - 1}",
                fix,
            )
        own = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"{layer}.")}
        down = own.get("down.weight")
        rank = int(down.shape[0]) if down is not None and down.dim() == 2 else 0
        expected = {"norm_weight": (hidden_size,), "down.weight": (rank, hidden_size), "up.weight": (hidden_size, rank)}
        shapes = {k: tuple(v.shape) for k, v in own.items()}
        if rank == 0 or shapes != expected:
            raise UsageError(
                f"exit adapter file {str(path)!r} holds tensors {shapes} for layer {layer}, this model needs "
                f"norm_weight ({hidden_size},), down.weight (rank, {hidden_size}), up.weight ({hidden_size}, rank)",
                fix,
            )
        adapter = ExitAdapter(hidden_size, rank, eps)
        adapter.load_state_dict({k: v.float() for k, v in own.items()})
        adapters[layer] = adapter.eval()
    return adapters


def prompt_tokens_bytes(table: Any) -> bytes:
    from safetensors.torch import save

    return save({"prompt_tokens": table.detach().contiguous()})


def load_prompt_tokens(path: str | Path, hidden_size: int) -> Any:
    """Prompt tokens [m, hidden] (calibration/prompt_tokens.py), checked against the model."""
    from adaptive_export.runtimes.limits import MAX_PROMPT_TOKENS

    fix = "train prompt tokens for this model with --prompt-tokens N"
    missing = f"{fix}, or pass a prompt_tokens.safetensors file written by a previous build"
    tensors = _read_tensors(path, "prompt tokens file", missing, fix)
    table = tensors.get("prompt_tokens")
    if (
        table is None
        or table.dim() != 2
        or table.shape[1] != hidden_size
        or not 1 <= table.shape[0] <= MAX_PROMPT_TOKENS
    ):
        shape = None if table is None else tuple(table.shape)
        raise UsageError(
            f"prompt tokens file {str(path)!r} holds prompt_tokens of shape {shape}, this model needs "
            f"(1..{MAX_PROMPT_TOKENS}, {hidden_size})",
            fix,
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
    recorded_dims = bundle.model.to_json()
    if loaded.spec.to_json() != {k: recorded_dims.get(k) for k in loaded.spec.to_json()}:
        raise UsageError(
            f"model {loaded.source!r} does not match the bundle's dimensions",
            "pass the model the bundle was built from with --model",
        )
    parts = ModelParts(loaded.hf_model, loaded.spec)
    if ROUTERS_FILE in bundle.manifest.files:  # only listed (checksummed) files are opened
        parts.routers = load_routers(bundle.path(ROUTERS_FILE), loaded.spec.num_layers, loaded.spec.hidden_size)
    if ADAPTERS_FILE in bundle.manifest.files:
        parts.exit_adapters = load_adapters(
            bundle.path(ADAPTERS_FILE), loaded.spec.hidden_size, loaded.spec.rms_norm_eps, loaded.spec.num_layers
        )
    if PROMPT_TOKENS_FILE in bundle.manifest.files:
        parts.prompt_tokens = load_prompt_tokens(bundle.path(PROMPT_TOKENS_FILE), loaded.spec.hidden_size)
    if bundle.draft_vocab_ids is not None:
        import torch

        parts.draft_vocab = torch.from_numpy(bundle.draft_vocab_ids.copy())
    return loaded, parts
