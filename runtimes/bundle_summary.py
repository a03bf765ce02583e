"""`inspect` (the command): what a bundle holds and can do, from its manifest alone (fast,
torch-free). Named bundle_summary, not inspect, so it does not shadow the standard library."""

from __future__ import annotations

import json
from typing import TypedDict

from adaptive_export.runtimes.bundle import Bundle, load_bundle, parse_manifest, read_listed
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.limits import MAX_CALIBRATION_BYTES
from adaptive_export.runtimes.manifest import GraphEntry
from adaptive_export.runtimes.manifest_fields import is_number
from adaptive_export.runtimes.manifest_graphs import DRAFT_FIELDS
from adaptive_export.runtimes.manifest_prompt_rows import PromptRows
from adaptive_export.runtimes.packed_ops import library_path

# One graph's summary: kind, layers (how many), config, exit_layer, precision, each draft
# source's graph field (DRAFT_FIELDS, by key), draft_vocab.
GraphSummary = dict[str, object]


class ConfigSummary(TypedDict):
    id: str
    kept: list[int]
    skipped: int  # layers the configuration skips
    engines: dict[str, str]
    calibration_share: float | None
    skip_adapters: bool  # its decode adapts the kept layers (FiRST's LoRA compensation)


class BundleSummary(TypedDict):
    """What `inspect` prints, and writes as JSON with --json (so a dict, with these keys typed)."""

    bundle: str
    model: dict[str, object]  # ModelDims.to_json()
    max_len: int
    dtype: str
    bytes: int
    weight_bytes: int
    size_ratio: float | None
    backends: dict[str, list[str]]
    graphs: dict[str, GraphSummary]
    configs: list[ConfigSummary]
    routers: bool
    router_threshold: float
    speculation: dict[str, object] | None  # Speculation.to_json()
    prompt_rows: dict[str, int]  # rows per prompt kind as build measured them (empty: the runtime's rule)
    prompt_decoders: dict[str, str]  # per measured kind: plain, floor or growing (runtimes/rows_choice.py)
    prompt_rows_costs: dict[str, dict[str, float]]  # per kind: steps per token of each two-row decoder
    prompt_rows_machine: str  # where build timed the passes ("" in older bundles)
    chat_template: bool
    weight_form: str  # how the onnx engines hold quantized weights (WEIGHT_FORMS), "float32" when they are not
    packed_ops_library: bool  # whether this installation has the op library packed engines need


# the onnx backend's `quantize` (and, native, its recorded form) -> what inspect calls its weights
WEIGHT_FORMS = {
    "packed": "packed rows (the GGUF's own bytes, MatMulPacked/GatherPacked)",
    "nbits": "MatMulNBits (the GGUF's blocks converted)",
    "int8": "MatMulNBits (int8 re-quantized)",
    "int4": "MatMulNBits (int4 re-quantized)",
}


def weight_form(bundle: Bundle) -> str:
    """The onnx engines' weight form as the manifest records it: a WEIGHT_FORMS key, or "float32"."""
    onnx = bundle.manifest.backends.get("onnx")
    if onnx is None or onnx.quantize == "none":
        return "float32"
    return onnx.native_form or onnx.quantize


def calibration_shares(bundle: Bundle) -> dict[str, float | None]:
    """Configuration id -> share of calibration prompts it served, from calibration.json
    (optional: a malformed file is a bad bundle, exit 2)."""
    relative = bundle.manifest.calibration
    if not relative:
        return {}
    data = parse_manifest(
        read_listed(bundle, relative, MAX_CALIBRATION_BYTES), relative
    )  # strict JSON, duplicate keys refused
    chosen = (
        data.get("configs", {}).get("chosen", [])
        if isinstance(data, dict) and isinstance(data.get("configs", {}), dict)
        else None
    )
    ok = isinstance(chosen, list) and all(
        isinstance(c, dict)
        and isinstance(c.get("id"), str)
        and (
            c.get("share") is None
            or (isinstance(c["share"], (int, float)) and not isinstance(c["share"], bool) and 0 <= c["share"] <= 1)
        )
        for c in (chosen if isinstance(chosen, list) else [])
    )
    if not ok or not isinstance(chosen, list):
        raise UsageError(
            f"the bundle's {relative!r} is malformed (configs.chosen must list {{id, share}})",
            "rebuild the bundle with `adaptive-export build`",
        )
    return {c["id"]: c.get("share") for c in chosen}


def describe(directory: str) -> BundleSummary:
    """What `inspect` prints (and writes with --json): the manifest's summary."""
    bundle = load_bundle(directory, verify="size")
    m = bundle.manifest
    shares = calibration_shares(bundle)
    total = sum(e.bytes for e in m.files.values())
    onnx = m.backends.get("onnx")
    weight_bytes = onnx.weight_bytes if onnx is not None else 0
    return {
        "bundle": str(directory),
        "model": m.model.to_json(),
        "max_len": m.max_len,
        "dtype": m.dtype,
        "bytes": total,
        "weight_bytes": weight_bytes,
        "size_ratio": round(total / weight_bytes, 4) if weight_bytes else None,
        "backends": {name: sorted(entry.graphs) for name, entry in m.backends.items()},
        "graphs": {name: _graph_summary(g) for name, g in m.graphs.items()},
        "configs": [
            {
                "id": c.id,
                "kept": list(c.kept),
                "skipped": m.model.num_layers - len(c.kept),
                "engines": dict(c.engines),
                "calibration_share": shares.get(c.id),
                "skip_adapters": m.graph(c.decode).skip_adapters,
            }
            for c in m.configs
        ],
        "routers": m.graph("prefill").router_scores,
        "router_threshold": m.router_threshold,
        "speculation": m.speculation.to_json() if m.speculation else None,
        "prompt_rows": dict(m.prompt_rows.rows) if m.prompt_rows else {},
        "prompt_decoders": {kind: m.prompt_rows.decoder_of(kind) for kind in m.prompt_rows.rows}
        if m.prompt_rows
        else {},
        "prompt_rows_costs": _rows_costs(m.prompt_rows),
        "prompt_rows_machine": m.prompt_rows.machine.describe() if m.prompt_rows and m.prompt_rows.machine else "",
        "chat_template": m.tokenizer.chat is not None,
        "weight_form": weight_form(bundle),
        "packed_ops_library": library_path() is not None,
    }


def _rows_costs(rows: PromptRows | None) -> dict[str, dict[str, float]]:
    """Each counted kind's growing and floor cost per token, as build priced them."""
    if rows is None or rows.counts is None or rows.machine is None:
        return {}
    measured = rows.extra.get("measured", {})
    growing, floor = measured.get("cost_per_token", {}), measured.get("floor_cost_per_token", {})
    return {
        kind: {"growing": float(growing[kind]), "floor": float(floor[kind])}
        for kind in rows.counts
        if is_number(growing.get(kind)) and is_number(floor.get(kind))
    }


def _rows_line(info: BundleSummary) -> str:
    """`edit 2 (growing: 0.80, floor 0.85 steps/token), chat 1 (plain: ...); measured on CPU`."""
    if not info["prompt_rows"]:
        return "not measured (the runtime's rule)"
    parts = []
    for kind, rows in info["prompt_rows"].items():
        costs = info["prompt_rows_costs"].get(kind)
        priced = f"; growing {costs['growing']:.2f}, floor {costs['floor']:.2f} steps/token" if costs else ""
        parts.append(f"{kind} {rows} ({info['prompt_decoders'].get(kind, 'growing')}{priced})")
    where = info["prompt_rows_machine"]
    return ", ".join(parts) + (f"; measured on {where} (re-timed where run on another machine)" if where else "")


def needs_library(info: BundleSummary) -> bool:
    """Whether the bundle's engines need the op library and this installation lacks it."""
    return info["weight_form"] == "packed" and not info["packed_ops_library"]


def _graph_summary(graph: GraphEntry) -> GraphSummary:
    return {
        "kind": graph.kind,
        "layers": len(graph.layers),
        "config": graph.config,
        "exit_layer": graph.exit_layer,
        "precision": graph.precision,
        **graph.draft_fields_json(),
        "draft_vocab": graph.draft_vocab,
    }


def render(info: BundleSummary) -> str:
    model = info["model"]
    lines = [
        f"bundle     {info['bundle']}",
        f"model      {model.get('source')} ({model.get('model_type', '?')}, {model['num_layers']} layers, "
        f"hidden {model['hidden_size']}, heads {model['num_heads']}/{model['num_kv_heads']} kv, "
        f"vocab {model['vocab_size']})",
        f"size       {info['bytes'] / 1e6:.1f} MB total, "
        f"weights {info['weight_bytes'] / 1e6:.1f} MB stored once (x{info['size_ratio']})",
        f"max_len    {info['max_len']} tokens, dtype {info['dtype']}, "
        f"chat template {'yes' if info['chat_template'] else 'no'}",
        f"weights    {WEIGHT_FORMS.get(info['weight_form'], info['weight_form'])}; packed-row op library "
        + ("installed" if info["packed_ops_library"] else "not installed")
        + (" (this bundle needs it: rebuild with --native-form nbits)" if needs_library(info) else ""),
        "routers    "
        + ("yes, threshold " + str(info["router_threshold"]) if info["routers"] else "no (always the full model)"),
        f"backends   {', '.join(f'{b} ({len(g)} engines)' for b, g in info['backends'].items())}",
        "configurations:",
    ]
    for c in info["configs"]:
        share = (
            "" if c["calibration_share"] is None else f", served {c['calibration_share']:.0%} of calibration prompts"
        )
        engines = ", ".join(f"{role} {name}" for role, name in c["engines"].items())
        adapted = ", skip adapters" if c["skip_adapters"] else ""
        lines.append(
            f"  {c['id']:10} keeps {len(c['kept'])} layers, skips {c['skipped']}{adapted}{share}; engines: {engines}"
        )
        if c["skipped"]:  # the shorter list says which layers the engine runs
            skipped = sorted(set(range(c["skipped"] + len(c["kept"]))) - set(c["kept"]))  # every layer, less kept
            lines.append(
                f"  {'':10} " + (f"skipped: {skipped}" if len(skipped) <= len(c["kept"]) else f"kept: {c['kept']}")
            )
    spec = info["speculation"]
    lines.append(f"speculation {json.dumps(spec) if spec else 'none'}")
    lines.append(f"decode rows per prompt kind: {_rows_line(info)}")
    lines.append("graphs:")
    for name, g in info["graphs"].items():
        extras = [
            f"{g['precision']} weights" if g.get("precision") else "",
            *(f"{g[key]} {key.replace('_', ' ')}" if g.get(key) else "" for _, key in DRAFT_FIELDS),
            f"head over {g['draft_vocab']} tokens" if g.get("draft_vocab") else "",
        ]
        lines.append(f"  {name:24} {g['kind']:8} {g['layers']:3} layers" + "".join(f", {e}" for e in extras if e))
    return "\n".join(lines)
