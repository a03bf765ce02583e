"""The model a build reads is checked once, right after its config is read and before anything
is sized by it: every dimension an integer within the runtime's own bounds (runtimes/limits.py,
the same ones runtimes/manifest.py enforces on a bundle), the norm epsilon and rope bases finite
and positive, heads consistent with each other and with the hidden size, and the fp32 weights
within the machine's memory. A model file may come from an untrusted source: a config that
passes here cannot make the build hang, allocate without bound, or write a bundle the runtime
refuses. docs/hardening.md, "Hostile model files".
"""

from __future__ import annotations

import json
import math
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptive_export.graphs.spec import ModelSpec
from adaptive_export.runtimes import limits
from adaptive_export.runtimes.errors import UsageError

MAX_CONFIG_BYTES = 4 << 20
MAX_SIDE_FILE_BYTES = 16 << 20  # tokenizer_config.json, chat templates, vocab.json... (Gemma 3's largest: 4.7 MB)
# what transformers reads whole beside the weights: in a model directory, every file of these patterns
# (a slow tokenizer's vocabulary files have class-specific names); beside a .gguf, the names it looks up
SIDE_FILE_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "additional_chat_templates/*")
GGUF_SIDE_FILE_PATTERNS = (
    "tokenizer*.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.*",
    "generation_config.json",
    "additional_chat_templates/*",
)
SIDE_FILE_CAPS = {"tokenizer.json": limits.MAX_TOKENIZER_JSON_BYTES, "config.json": MAX_CONFIG_BYTES}
MAX_CONFIG_NESTING = 4  # text_config inside a wrapper inside a wrapper: deeper is no model we know
MAX_POSITIONS = 1 << 24  # max_position_embeddings and sliding windows: far above any released model
FP32_BYTES = 4
SIZING_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class IntRule:
    """An HF config field that must be an integer in 1..high (when present; None allowed if optional)."""

    key: str
    high: int
    required: bool = True


@dataclass(frozen=True)
class FloatRule:
    """An HF config field that must be a finite number in (0, high)."""

    key: str
    high: float
    required: bool = False


INT_RULES = (
    IntRule("num_hidden_layers", limits.MAX_LAYERS),
    IntRule("hidden_size", limits.MAX_HIDDEN),
    IntRule("num_attention_heads", limits.MAX_HEADS),
    IntRule("num_key_value_heads", limits.MAX_HEADS, required=False),
    IntRule("head_dim", limits.MAX_HEAD_DIM, required=False),
    IntRule("intermediate_size", limits.MAX_INTERMEDIATE),
    IntRule("vocab_size", limits.MAX_VOCAB),
    IntRule("max_position_embeddings", MAX_POSITIONS, required=False),
    IntRule("sliding_window", MAX_POSITIONS, required=False),
)
FLOAT_RULES = (
    FloatRule("rms_norm_eps", 1.0, required=True),
    FloatRule("rope_theta", math.inf),
    FloatRule("query_pre_attn_scalar", math.inf),
)


def _bad(source: str, problem: str, fix: str = "") -> UsageError:
    return UsageError(
        f"the model {source!r} is refused: {problem}",
        fix or "pass an intact model (its config.json or GGUF metadata has impossible dimensions)",
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(fields: Mapping[str, Any], source: str, where: str = "") -> None:
    """Each field's type and range, one rule per field; an absent field is left to the config's
    default (a required one present as null is refused). `where`: the nested config's path
    (`text_config.`), so the line names the field as config.json spells it."""
    for rule in INT_RULES:
        value = fields.get(rule.key)
        if rule.key not in fields or (value is None and not rule.required):
            continue
        if not (isinstance(value, int) and _is_int(value) and 1 <= value <= rule.high):
            raise _bad(source, f"{where}{rule.key} = {value!r} is not an integer in 1..{rule.high}")
    for frule in FLOAT_RULES:
        value = fields.get(frule.key)
        if frule.key not in fields or (value is None and not frule.required):
            continue
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        if not (math.isfinite(number) and 0 < number < frule.high):
            raise _bad(source, f"{where}{frule.key} = {value!r} is not a finite number in (0, {frule.high:g})")


def _check_heads(fields: Mapping[str, Any], source: str, where: str = "") -> int:
    """Heads that fit each other and the hidden size; returns the head size."""
    heads, hidden = fields["num_attention_heads"], fields["hidden_size"]
    kv_heads = fields.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise _bad(
            source, f"{where}num_attention_heads {heads} is not a multiple of {where}num_key_value_heads {kv_heads}"
        )
    if hidden % heads:  # also with an explicit head_dim: no supported family has such a model
        raise _bad(source, f"{where}hidden_size {hidden} is not a multiple of {where}num_attention_heads {heads}")
    head_dim = fields.get("head_dim") or hidden // heads
    if not 1 <= head_dim <= limits.MAX_HEAD_DIM:
        raise _bad(source, f"the head size {head_dim} is outside 1..{limits.MAX_HEAD_DIM}")
    return int(head_dim)


def fp32_weight_bytes(fields: Mapping[str, Any], head_dim: int) -> int:
    """The fp32 bytes of the decoder's weights (embeddings, attention, MLP; norms are negligible)."""
    hidden, layers = fields["hidden_size"], fields["num_hidden_layers"]
    heads = fields["num_attention_heads"]
    kv_heads = fields.get("num_key_value_heads") or heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    per_layer = attention + 3 * hidden * fields["intermediate_size"]
    tables = 1 if fields.get("tie_word_embeddings", True) else 2
    return FP32_BYTES * (layers * per_layer + tables * fields["vocab_size"] * hidden)


def check_dimensions(fields: Mapping[str, Any], source: str, where: str = "") -> None:
    """Refuse a config (HF field names) whose dimensions the graphs or the runtime cannot take,
    or whose fp32 weights would not fit in this machine's memory, before anything is allocated."""
    _check_fields(fields, source, where)
    if not all(fields.get(key) is not None for key in SIZING_KEYS):
        return  # a partial config.json: transformers fills in its defaults, checked again as a ModelSpec
    head_dim = _check_heads(fields, source, where)
    needed = fp32_weight_bytes(fields, head_dim)
    available = limits.available_memory()
    if available is not None and needed > available:
        raise _bad(
            source,
            f"its weights need {needed / 2**30:.1f} GiB in fp32, more than the {available / 2**30:.1f} GiB available",
            "build a smaller model, or on a machine with more memory",
        )


# GGUF tensor (after "blk.N." for a layer's) -> its ggml shape (ne0 first) from the model's dimensions:
# h hidden, q heads x head size, k kv heads x head size, f the MLP's width, d the head size, v the vocabulary
GGUF_SHAPES = {
    "token_embd.weight": "hv",
    "output.weight": "hv",
    "output_norm.weight": "h",
    "attn_norm.weight": "h",
    "ffn_norm.weight": "h",
    "post_attention_norm.weight": "h",
    "post_ffw_norm.weight": "h",
    "attn_q.weight": "hq",
    "attn_k.weight": "hk",
    "attn_v.weight": "hk",
    "attn_output.weight": "qh",
    "attn_q.bias": "q",
    "attn_k.bias": "k",
    "attn_v.bias": "k",
    "attn_q_norm.weight": "d",
    "attn_k_norm.weight": "d",
    "ffn_gate.weight": "hf",
    "ffn_up.weight": "hf",
    "ffn_down.weight": "fh",
}


def check_gguf_tensor_shapes(
    fields: Mapping[str, Any], tensors: Iterable[tuple[str, tuple[int, ...]]], source: str
) -> None:
    """Each tensor the model's parameters are filled from declared with the shape its metadata's
    dimensions give (after check_dimensions): a tensor of the right bytes in another shape (an MLP
    width of 1 in the metadata, rope dimensions that are not the head size, a transposed matrix) is
    reshaped by transformers into a model whose bundle every run refuses, or fails minutes in."""
    if not all(_is_int(fields.get(key)) for key in SIZING_KEYS):
        return
    heads, hidden = fields["num_attention_heads"], fields["hidden_size"]
    kv_heads = fields.get("num_key_value_heads") or heads
    head_dim = fields.get("head_dim") or hidden // heads
    sizes = {
        "h": hidden,
        "q": heads * head_dim,
        "k": kv_heads * head_dim,
        "f": fields["intermediate_size"],
        "d": head_dim,
        "v": fields["vocab_size"],
    }
    for name, dims in tensors:
        layer, _, part = name.partition(".")[2].partition(".") if name.startswith("blk.") else ("", "", name)
        if layer and not (layer.isdigit() and int(layer) < fields["num_hidden_layers"]):
            raise _bad(source, f"GGUF tensor {name!r} names a layer past its {fields['num_hidden_layers']} layers")
        letters = GGUF_SHAPES.get(part)
        expected = tuple(sizes[letter] for letter in letters) if letters else dims
        if tuple(dims) != expected:
            raise _bad(
                source,
                f"GGUF tensor {name!r} has shape {tuple(dims)}, not the {expected} its metadata's dimensions give",
                "pass an intact .gguf file (its metadata and its tensors disagree)",
            )


def spec_fields(spec: ModelSpec) -> dict[str, Any]:
    """A ModelSpec under the HF config names check_dimensions reads (the dimensions as the graphs see them)."""
    return {
        "num_hidden_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_word_embeddings,
    }


def read_config_json(directory: Path, source: str, path: Path | None = None) -> dict[str, Any]:
    """config.json (bounded size) as a JSON object; NaN and Infinity are read as floats, so the
    field's own rule names them. `path`: the file to read instead (a Hub snapshot's blob)."""
    data = limits.read_regular(path or directory / "config.json", "model config", MAX_CONFIG_BYTES)
    try:
        config = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise _bad(source, f"its config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _bad(source, "its config.json is not a JSON object")
    return config


def nested_configs(
    config: Mapping[str, Any], where: str = "", depth: int = 0
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """The config and every sub-config it nests (`text_config`, `llm_config`, any `*_config` object),
    as (path prefix, fields): a multimodal wrapper keeps its decoder's dims there, and transformers
    builds that decoder's config class (which sizes lists by them) from the nested object."""
    yield where, config
    if depth >= MAX_CONFIG_NESTING:
        return
    for key, value in config.items():
        if isinstance(key, str) and key.endswith("_config") and isinstance(value, Mapping):
            yield from nested_configs(value, f"{where}{key}.", depth + 1)


def check_config_json(directory: Path, source: str, path: Path | None = None) -> None:
    """The raw config.json, before transformers builds a config class from it (some classes size
    lists by num_hidden_layers in their constructor): the top level and every nested `*_config`."""
    for where, fields in nested_configs(read_config_json(directory, source, path)):
        check_dimensions(fields, source, where)


def check_side_files(directory: Path, source: str, gguf: bool) -> None:
    """Every side file transformers may read whole (tokenizer_config.json, chat_template.jinja,
    generation_config.json, ...) a regular file of at most its cap in bytes, from stat alone: a 2 GB sparse one
    costs no disk and would be read into memory (10-23 s, then MemoryError). A Hub snapshot's file
    is a link to its blob, whose size is the one stat reports."""
    for pattern in GGUF_SIDE_FILE_PATTERNS if gguf else SIDE_FILE_PATTERNS:
        for path in sorted(directory.glob(pattern)):
            try:
                info = path.stat()
            except OSError:
                continue  # a dangling link: transformers skips it as absent
            name = path.relative_to(directory).as_posix()
            if not stat.S_ISREG(info.st_mode):  # transformers skips a FIFO silently (or blocks on it)
                raise _bad(
                    source,
                    f"its {name} is not a regular file (a FIFO, device, socket or directory)",
                    f"replace {name} with the model's own file (or remove it)",
                )
            size, cap = info.st_size, SIDE_FILE_CAPS.get(path.name, MAX_SIDE_FILE_BYTES)
            if size > cap:
                raise _bad(
                    source,
                    f"its {name} is {size:,} bytes, more than the {cap:,} a side file may hold",
                    f"replace {name} with the model's own file (or remove it)",
                )
