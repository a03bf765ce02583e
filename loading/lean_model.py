"""The model without its weights: what the memory-lean build traces and streams from.

A build that only exports needs the model's structure, not its fp32 weights: the large tensors
are traced as FakeTensors (shape and dtype, no storage) and read from the file one at a time
while the bundle is written (exporter/lean_export.py). Small tensors (norms, biases: every
1-D parameter) and the derived tables (rotary inv_freq, embedding scales: the buffers) are real,
because the exporter's optimizer folds and deduplicates them by value. Peak memory is then the
runtime of torch plus one tensor, not twice the fp32 model (docs/architecture.md section 2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from adaptive_export.loading.gguf_parses import one_parse_per_file
from adaptive_export.loading.gguf_weights import GGUFWeights
from adaptive_export.loading.model import (
    LoadedModel,
    check_model_files,
    load_config,
    load_tokenizer,
    model_source,
    spec_from_config,
)
from adaptive_export.runtimes.errors import UsageError

# a parameter with at most this many elements is read for real (every norm and bias; no linear)
SMALL_PARAMETER = 1 << 16


@dataclass
class LeanModel(LoadedModel):
    """A LoadedModel whose large parameters are FakeTensors, with the file that holds them."""

    weights: GGUFWeights | None = None


def is_fake(tensor: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def load_lean_model(model: str) -> LeanModel:
    """The model's structure with fake large weights, its small tensors read from the .gguf."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    directory, gguf_file = check_model_files(model)
    if gguf_file is None:
        raise UsageError(f"the memory-lean build reads .gguf files, and {model!r} is not one", "build it as usual")
    # transformers reads a .gguf for the config and again for the tokenizer, and rebuilds gguf's
    # tensor-name table for every module while mapping the weights' names: all shared in the block
    with one_parse_per_file():
        config = load_config(model, directory, gguf_file)
        spec = spec_from_config(config)
        hf_model = fake_model(config)
        tokenizer = load_tokenizer(model, directory, gguf_file)
        weights = GGUFWeights(directory / gguf_file, hf_model)
    _read_small_parameters(hf_model, weights)
    return LeanModel(hf_model, tokenizer, spec, model_source(model, directory, gguf_file), weights)


def fake_model(config: Any) -> Any:
    """The HF model built with FakeTensor parameters, its buffers recomputed for real."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    with FakeTensorMode(allow_non_fake_inputs=True):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf_model.eval().requires_grad_(False)
    _real_buffers(hf_model)
    return hf_model


def _real_buffers(hf_model: Any) -> None:
    """Rebuild the rotary modules outside the fake mode: their inv_freq tables are computed at
    construction from the config, and cost kilobytes. Other buffers (Gemma's embedding scale) stay
    fake: the graphs take those values from the architecture adapter, never from the buffer."""
    for name, module in list(hf_model.named_modules()):
        if not name.endswith("rotary_emb") or not any(is_fake(b) for b in module.buffers(recurse=False)):
            continue
        real = type(module)(config=module.config)
        for buffer_name, buffer in real.named_buffers(recurse=False):
            module.register_buffer(buffer_name, buffer, persistent=False)


def _read_small_parameters(hf_model: Any, weights: GGUFWeights) -> None:
    """Replace each small fake parameter (norms, biases) with its value from the file."""
    import torch

    for name, parameter in list(hf_model.named_parameters()):
        if parameter.numel() > SMALL_PARAMETER or not is_fake(parameter):
            continue
        if name not in weights:
            raise UsageError(
                f"the .gguf has no tensor for parameter {name!r}",
                "pass a complete .gguf file of a supported architecture",
            )
        owner, _, leaf = name.rpartition(".")
        value = torch.from_numpy(weights.array(name))
        setattr(hf_model.get_submodule(owner), leaf, torch.nn.Parameter(value, requires_grad=False))


def load_streamed_model(model: str) -> LoadedModel | None:
    """The fp32 model from a .gguf, its parameters filled one tensor at a time: the peak is the
    model, not transformers' dequantized state dict plus the model (12 GB for a 1.5B). None where
    the model keeps buffers the fake build cannot recompute (Gemma's embedding scale): transformers
    loads those."""
    lean = load_lean_model(model)
    if any(is_fake(b) for b in lean.hf_model.buffers()):
        return None
    weights = lean.weights
    assert weights is not None
    if not all(name in weights for name, p in lean.hf_model.named_parameters() if is_fake(p)):
        return None
    _fill_parameters(lean.hf_model, weights)
    return LoadedModel(lean.hf_model, lean.tokenizer, lean.spec, lean.source)


def _fill_parameters(hf_model: Any, weights: GGUFWeights) -> None:
    """Replace each fake parameter with its values, at every place that holds it (a tied head
    and embedding share one Parameter, and keep sharing it)."""
    import torch

    owners: dict[int, list[tuple[Any, str]]] = {}
    for name, parameter in hf_model.named_parameters(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        owners.setdefault(id(parameter), []).append((hf_model.get_submodule(owner), leaf))
    for name, parameter in list(hf_model.named_parameters()):
        if not is_fake(parameter):
            continue
        real = torch.nn.Parameter(torch.from_numpy(weights.array(name)), requires_grad=False)
        for module, leaf in owners[id(parameter)]:
            setattr(module, leaf, real)


def draft_vocab_rows(lean: LeanModel, ids: Any) -> Any:
    """The LM head's rows of a draft vocabulary (int64 ids), read from the .gguf row by row: the
    head's weight is a FakeTensor here, so a graph piece that scores those rows (an EAGLE head)
    takes these (ModelParts.draft_heads) instead of indexing it."""
    import torch

    from adaptive_export.graphs.architectures import architecture

    assert lean.weights is not None
    weight = architecture(lean.spec.model_type).lm_head(lean.hf_model).weight
    name = next(n for n, p in lean.hf_model.named_parameters() if p is weight)
    return torch.from_numpy(lean.weights.rows(name, ids.numpy()))
