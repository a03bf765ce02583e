"""Routed bundles with and without skip adapters (`build --routers ... --lora R`), on held-out prompts.

    python -m benchmarks.routed_lora --model gemma3 --bundles routed=DIR lora=DIR [--prompts 30]
                                     [--tokens 24] [--repeat 3] [--threads 2]

Each bundle picks its configuration per prompt at prefill, as `run` does. Per bundle: the mean
layers its choice skips, the teacher-forced top-1 agreement of that choice (its kept layers, its
adapters where the configuration has them) with the full model's own greedy continuation (fp32
PyTorch, the measure `build`'s quality floor uses), and decode TPOT: the runtime's own choice
(`--config auto`) against `--config full` of the same bundle, medians over the prompts of the
median of `--repeat` interleaved runs. `step share skipped`: the mean over prompts of the skipped
layers' weight bytes over the bytes a decode step reads (every layer plus the LM head, from the
bundle's tensor table); a decode step on a CPU is bound by reading them, so the cut FiRST's issue
asks is at least 0.9 x that share. Held-out prompts: samples/eval_prompts.jsonl, then
samples/spec_prompts.jsonl, none of them among build's calibration prompts.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_PROMPTS, ROOT, bench_parser, cpu_model, load_prompts, parse_and_pin, print_table

HEAD_NAMES = re.compile(r"lm_head|^output\.|token_embd|embed_tokens")


def layer_and_head_bytes(bundle: Path) -> tuple[dict[int, int], int]:
    """(weight bytes per layer, the LM head's bytes) from the bundle's ONNX tensor table."""
    tensors = json.loads((bundle / "manifest.json").read_text())["backends"]["onnx"]["tensors"]
    per_layer: dict[int, int] = {}
    head = 0
    for name, entry in tensors.items():
        if match := re.search(r"layers\.(\d+)\.", name):
            per_layer[int(match[1])] = per_layer.get(int(match[1]), 0) + entry["bytes"]
        elif HEAD_NAMES.search(name):
            head += entry["bytes"]
    return per_layer, head


@dataclass(frozen=True)
class PromptRow:
    config: str
    skipped: int
    step_share: float
    adapted: bool
    agreement: float
    tpot_auto: float
    tpot_full: float


def agreement_of(parts: Any, model: Any, seq: Any, kept: tuple[int, ...], adapted: bool) -> float:
    """Teacher-forced top-1 agreement of decoding with `kept` (and the bundle's adapters)."""
    from adaptive_export.calibration.routers import continuation_agreement
    from adaptive_export.calibration.skip_adapters import adapted_agreement, as_module_dict

    if adapted:
        adapters = as_module_dict({layer: parts.skip_adapters[layer] for layer in kept})
        return adapted_agreement(model, [seq], set(kept), adapters)
    return continuation_agreement(model, [seq], set(kept))


def measure_bundle(path: Path, loaded: Any, sequences: list[Any], prompts: list[str], args: Any) -> list[PromptRow]:
    from adaptive_export.calibration.routers import GatedModel
    from adaptive_export.loading.artifacts import load_parts
    from adaptive_export.runtimes import Generator

    generator = Generator(path, threads=args.threads)
    generator.codec.eos_ids = set()  # every run decodes exactly --tokens
    _, parts = load_parts(generator.bundle, args.model)
    model = GatedModel(loaded).eval()  # the fp32 stack every prompt's agreement runs on
    per_layer, head = layer_and_head_bytes(path)
    step_bytes = sum(per_layer.values()) + head
    rows = []
    for prompt, seq in zip(prompts, sequences, strict=True):
        runs: dict[str, list[float]] = {"auto": [], "full": []}
        chosen = None
        for _ in range(args.repeat):
            for config in ("auto", "full"):
                stats = generator.generate(prompt, max_new_tokens=args.tokens, mode="ar", config=config).stats
                runs[config].append(stats.tpot_ms)
                chosen = stats if config == "auto" else chosen
        assert chosen is not None
        kept = tuple(chosen.kept_layers)
        rows.append(
            PromptRow(
                chosen.config,
                chosen.skipped_layers,
                sum(b for layer, b in per_layer.items() if layer not in kept) / step_bytes,
                chosen.skip_adapters,
                agreement_of(parts, model, seq, kept, chosen.skip_adapters),
                statistics.median(runs["auto"]),
                statistics.median(runs["full"]),
            )
        )
    return rows


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", required=True, help="the model the bundles were built from (packaged name or path)")
    parser.add_argument("--bundles", nargs="+", required=True, help="NAME=DIR per bundle")
    parser.add_argument("--prompts", type=int, default=30, help="held-out prompts")
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt (agreement and TPOT)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs per prompt and configuration")
    args = parse_and_pin(parser)
    from adaptive_export.calibration.greedy import greedy_sequences
    from adaptive_export.calibration.routers import TrainingSequence
    from adaptive_export.loading.model import load_model

    prompts = (load_prompts(DEFAULT_PROMPTS) + load_prompts(ROOT / "samples" / "spec_prompts.jsonl"))[: args.prompts]
    loaded = load_model(args.model)
    sequences = [TrainingSequence(*s) for s in greedy_sequences(loaded, prompts, args.tokens, "held-out")]
    table = []
    for name, directory in (spec.split("=", 1) for spec in args.bundles):
        rows = measure_bundle(Path(directory), loaded, sequences, prompts, args)
        auto, full = statistics.median(r.tpot_auto for r in rows), statistics.median(r.tpot_full for r in rows)
        table.append(
            {
                "bundle": name,
                "mean layers skipped": f"{statistics.mean(r.skipped for r in rows):.2f}",
                "prompts adapted": sum(r.adapted for r in rows),
                "configs": ",".join(sorted({r.config for r in rows})),
                "agreement": f"{statistics.mean(r.agreement for r in rows):.3f}",
                "step share skipped": f"{statistics.mean(r.step_share for r in rows):.4f}",
                "TPOT auto ms": f"{auto:.2f}",
                "TPOT full ms": f"{full:.2f}",
                "auto / full": f"{auto / full:.3f}",
                "median per-prompt auto / full": f"{statistics.median(r.tpot_auto / r.tpot_full for r in rows):.3f}",
            }
        )
    shape = f"{len(prompts)} held-out prompts x {args.tokens} tokens"
    print(f"\n{args.model}: {shape}, {cpu_model()}, {args.threads} threads")
    print_table(table, list(table[0]))


if __name__ == "__main__":
    main()
