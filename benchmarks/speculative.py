"""Self-speculation on any bundle (SmolLM2, Gemma 3, ...): per draft source and k, acceptance, tokens per
round, TPOT, speed-up over the project's own AR decoding and over HF `assistant_early_exit` at the same E.

    python -m benchmarks.speculative --bundle bundles/smollm2-spec [--threads 2]

Chat prompts (samples/eval_prompts.jsonl) and rewrite/repeat prompts (the rewrite part of
samples/spec_prompts.jsonl, where prompt lookup should shine) are reported separately.
Medians over prompts x repetitions, one warm-up excluded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from adaptive_export.runtimes.manifest import ConfigEntry
from benchmarks.common import (
    DEFAULT_PROMPTS,
    ROOT,
    bench_parser,
    cpu_model,
    load_prompts,
    median_of,
    parse_and_pin,
    print_table,
)

NEW_TOKENS = 32
REWRITE_WORDS = ("Rewrite", "Summarize", "Repeat", "Fix", "Copy", "Make this", "Turn this", "Edit this")


def rewrite_prompts() -> list[str]:
    return [p for p in load_prompts(ROOT / "samples" / "spec_prompts.jsonl") if p.startswith(REWRITE_WORDS)]


def bench_runtime(gen, prompts: list[list[int]], repeat: int, **kwargs) -> dict[str, float]:
    gen.generate(prompts[0], max_new_tokens=NEW_TOKENS, **kwargs)
    tpot, acceptance, per_round, draft_ms, verify_ms = [], [], [], [], []
    for ids in prompts:
        for _ in range(repeat):
            stats = gen.generate(ids, max_new_tokens=NEW_TOKENS, **kwargs).stats
            tpot.append(stats.tpot_ms)
            spec = stats.speculation
            if spec:
                rounds = max(spec["rounds"], 1)
                acceptance.append(spec["acceptance"])
                per_round.append((stats.new_tokens - 1) / rounds)
                draft_ms.append(spec["draft_ms"] / rounds)
                verify_ms.append(spec["verify_ms"] / rounds)
    return {
        "tpot_ms": median_of(tpot),
        "acceptance": median_of(acceptance) if acceptance else None,
        "tokens_per_round": median_of(per_round) if per_round else None,
        "draft_ms_per_round": median_of(draft_ms) if draft_ms else None,
        "verify_ms_per_round": median_of(verify_ms) if verify_ms else None,
    }


def bench_hf_early_exit(model, prompts: list[list[int]], exit_layer: int, repeat: int) -> float:
    import torch

    tpot = []
    for ids in prompts:
        x = torch.tensor([ids])
        for _ in range(repeat):
            with torch.no_grad():
                started = time.perf_counter()
                model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    assistant_early_exit=exit_layer,
                    pad_token_id=0,
                )
                tpot.append((time.perf_counter() - started) * 1e3 / NEW_TOKENS)
    return median_of(tpot)


def measured_row(gen, ids: list[list[int]], set_name: str, ar: float, repeat: int, label: str, **kwargs) -> dict:
    """One table row: bench_runtime's medians (`kwargs` go to generate) under `label`, and the
    speed-up over plain decoding."""
    r = bench_runtime(gen, ids, repeat, **kwargs)
    return {"prompts": set_name, "mode": label, **r, "speedup_vs_ar": ar / r["tpot_ms"]}


def speculation_json(gen) -> dict:
    """The bundle's speculation section as written (calibration's notes included), {} without one."""
    return gen.bundle.manifest.speculation.to_json() if gen.bundle.manifest.speculation else {}


def precision_rows(gen, ids: list[list[int]], set_name: str, ar: float, repeat: int, label: str = "") -> list[dict]:
    """Plain decoding at the precision draft's precision (the fast, lossy setting) and speculation
    with it at k = 2, 4 and the calibrated k; `label` names a compared bundle's draft."""
    full = gen.bundle.config("full").engines
    spec = speculation_json(gen)
    graph = gen.bundle.graph(full["precision_draft"])
    name = f"{graph.precision}" + (f", head over {graph.draft_vocab} tokens" if graph.draft_vocab else "") + label
    # the draft engine as the decode engine of an extra in-memory configuration (prefill stays the bundle's)
    configs = gen.bundle.manifest.configs
    if not any(c.id == "draft_precision" for c in configs):
        extra = ConfigEntry("draft_precision", gen.bundle.config("full").kept, {"decode": full["precision_draft"]})
        gen.bundle.manifest = dataclasses.replace(gen.bundle.manifest, configs=(*configs, extra))
    rows = []
    if not graph.draft_vocab:  # a reduced head cannot decode on its own: its tokens are a subset
        label = f"ar at the draft's precision ({name}, lossy)"
        rows.append(measured_row(gen, ids, set_name, ar, repeat, label, config="draft_precision"))
    for k in sorted({2, 4, int((spec.get("precision") or {}).get("draft_len", 4))}):
        label = f"spec precision ({name} draft) k={k}"
        rows.append(measured_row(gen, ids, set_name, ar, repeat, label, mode="spec", draft="precision", draft_len=k))
    return rows


def build_parser():
    parser = bench_parser(__doc__, bundle="a bundle built with --speculate (draft/verify engines)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per prompt set")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF assistant_early_exit baseline")
    parser.add_argument(
        "--prepack",
        action="store_true",
        help="prepack the decode and verify engines (ORT; +1 copy of the weights each); "
        "default: the runtime's own choice",
    )
    parser.add_argument(
        "--compare-draft",
        default=None,
        metavar="DIR",
        help="another bundle of the same model and verifier (e.g. built without --draft-vocab): its precision draft "
        "is measured in the same run, against this bundle's plain decoding",
    )
    parser.add_argument("--json", default=None)
    return parser


def prompt_set_rows(gen, other, ids: list[list[int]], set_name: str, args, hf_model) -> list[dict]:
    """Every row of one prompt set: plain decoding, each draft source the bundle has, auto, HF."""
    full = gen.bundle.config("full").engines
    spec = speculation_json(gen)
    exit_layer = spec.get("exit_layer")
    ar = bench_runtime(gen, ids, args.repeat)["tpot_ms"]
    rows = [{"prompts": set_name, "mode": "ar (project)", "tpot_ms": ar, "speedup_vs_ar": 1.0}]

    def row(label: str, **kwargs) -> dict:
        return measured_row(gen, ids, set_name, ar, args.repeat, label, **kwargs)

    for k in (2, 4):
        rows.append(row(f"spec prompt_lookup k={k}", mode="spec", draft="prompt_lookup", draft_len=k))
    if exit_layer:
        for k in (2, 4):  # k=1 yields one token a round by construction (no bonus token)
            rows.append(row(f"spec early_exit E={exit_layer} k={k}", mode="spec", draft="early_exit", draft_len=k))
    if "precision_draft" in full:
        rows += precision_rows(gen, ids, set_name, ar, args.repeat)
    if other is not None:
        rows += precision_rows(other, ids, set_name, ar, args.repeat, label=f" of {Path(args.compare_draft).name}")
    if "prompt_tokens" in full:  # prompt tokens: drafts guessed by the previous verify pass
        m = gen.bundle.graph(full["prompt_tokens"]).prompt_tokens
        for k in range(1, m + 1):
            rows.append(
                row(f"spec prompt_tokens (m={m} prompt tokens) k={k}", mode="spec", draft="prompt_tokens", draft_len=k)
            )
    rows.append(row(f"auto ({spec.get('source') if spec.get('auto_enabled') else 'gated prompt_lookup'})", mode="auto"))
    if hf_model is not None:
        hf = bench_hf_early_exit(hf_model, ids, exit_layer, 1)
        rows.append(
            {
                "prompts": set_name,
                "mode": f"HF assistant_early_exit={exit_layer}",
                "tpot_ms": hf,
                "speedup_vs_ar": ar / hf,
            }
        )
    return rows


def setting_line(gen, args) -> str:
    """The run's setting above the table: CPU, model, precision, threads, prompts, prepacking."""
    spec = speculation_json(gen)
    onnx_entry = gen.bundle.backend_entry("onnx")
    precision = onnx_entry.quantize
    if precision != "none":
        precision += f" accuracy {(onnx_entry.extra.get('quant_options') or {}).get('accuracy_level')}"
    model = gen.bundle.model.to_json()
    return (
        f"{cpu_model()}, {os.cpu_count()} CPUs; {model.get('source')} ({model['model_type']}, "
        f"{model['num_layers']} layers) {gen.bundle.manifest.dtype} ({precision}), {args.threads} threads, "
        f"{NEW_TOKENS} new tokens, {args.prompts} prompts x {args.repeat} (medians), "
        f"prepack {'decode+verify' if args.prepack else 'runtime default'}; "
        f"exit adapter at E={spec.get('exit_layer')}: {bool(spec.get('adapter'))}"
    )


def main() -> None:
    args = parse_and_pin(build_parser())
    from adaptive_export.runtimes import Generator

    full = Generator(Path(args.bundle), verify="size").bundle.config("full").engines
    prepack = [full["decode"], full.get("verify", "")] if args.prepack else None
    gen = Generator(Path(args.bundle), threads=args.threads, prepack=prepack)
    gen.codec.eos_ids = set()
    other = Generator(Path(args.compare_draft), threads=args.threads, prepack=prepack) if args.compare_draft else None
    if other is not None:
        other.codec.eos_ids = set()
    spec = speculation_json(gen)
    sets = {"chat": load_prompts(DEFAULT_PROMPTS, args.prompts), "rewrite": rewrite_prompts()[: args.prompts]}
    hf_model = None
    if not args.no_hf and spec.get("exit_layer"):
        from adaptive_export.loading.model import load_model

        hf_model = load_model(gen.bundle.model.source or "smollm2").hf_model
    rows = []
    for set_name, texts in sets.items():
        rows += prompt_set_rows(gen, other, [gen.codec.encode(t) for t in texts], set_name, args, hf_model)
    print(setting_line(gen, args))
    print_table(
        rows,
        [
            "prompts",
            "mode",
            "acceptance",
            "tokens_per_round",
            "draft_ms_per_round",
            "verify_ms_per_round",
            "tpot_ms",
            "speedup_vs_ar",
        ],
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
