"""Would FiRST's LoRA compensation let a model skip more layers at the same quality floor?

    python -m benchmarks.skip_adapters [--model smollm2] [--skips 1,2,3,4] [--rank 8] [--epochs 2]
                                       [--spec-prompts 40] [--train-tokens 48] [--order 3,5,7,4]
                                       [--docstrings 0]

The measurement behind `build --routers train --lora R` (calibration/skip_adapters.py, whose
training and agreement this uses), one skip set at a time. Static proxy of the router's choice: skip the k layers
that cost least alone (each layer's teacher-forced agreement when it alone is skipped, on the
training prompts; `--order` gives the order instead), then measure on held-out prompts the
teacher-forced top-1 agreement with the full model's own greedy continuation, without and with
adapters. Semantics are the runtime's: prefill (prompt rows) runs every layer unadapted; decode
(continuation rows) bypasses skipped layers and adds, after every kept layer, a low-rank residual
adapter h -> h + up(silu(down(norm(h)))) (graphs/adaptive.py's ExitAdapter: two small MatMuls per
layer in a decode graph). Adapters train per skip set by self-distillation (KL to the full model's
logits on continuation rows), backbone frozen, Adam, fixed seed.

Training prompts: samples/calib_prompts.jsonl plus the first `--spec-prompts` of
samples/spec_prompts.jsonl; held-out: samples/eval_prompts.jsonl plus the rest of spec_prompts.
`--docstrings N` adds N documents of shipped text (calibration/draft_data.py's standard-library
docstrings, no generation, up to DOCSTRING_TOKENS each): their first DOCSTRING_PROMPT tokens run
as prompt rows, the rest as decode rows, teacher-forced, so the adapters see far more text than
the model's few thousand greedy tokens (FiRST fine-tunes on whole datasets).
The quality floor is build's default (calibration/router_pipeline.py DEFAULT_MIN_AGREEMENT).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn
from tqdm import tqdm

from adaptive_export.calibration.draft_data import stdlib_documents
from adaptive_export.calibration.greedy import greedy_sequences
from adaptive_export.calibration.measure import calibration_prompts
from adaptive_export.calibration.router_pipeline import DEFAULT_MIN_AGREEMENT
from adaptive_export.calibration.routers import GatedModel, continuation_agreement
from adaptive_export.calibration.routers import TrainingSequence as Seq
from adaptive_export.calibration.skip_adapters import adapted_agreement, as_module_dict, train_skip_adapters
from benchmarks.common import DEFAULT_PROMPTS, ROOT, bench_parser, cpu_model, load_prompts, parse_and_pin, print_table

HELD_OUT_TOKENS = 24
DOCSTRING_TOKENS = 96
DOCSTRING_PROMPT = 16


@dataclass(frozen=True)
class Study:
    """What to measure: skip sets of these sizes along `order` (empty: measured), adapters' rank and epochs."""

    skips: tuple[int, ...]
    rank: int
    epochs: int
    order: tuple[int, ...] = ()


@dataclass(frozen=True)
class SkipRow:
    """One skip set: its held-out agreement without and with trained adapters."""

    skipped: tuple[int, ...]
    heldout_without: float
    heldout_with: float
    train_with: float
    train_seconds: float


def train_adapters(model: GatedModel, seqs: Sequence[Seq], kept: set[int], rank: int, epochs: int) -> nn.ModuleDict:
    """Adapters trained for this one skip set (build trains one shared set over the routers' sets)."""
    return as_module_dict(train_skip_adapters(model, seqs, [frozenset(kept)], rank, epochs).adapters)


def cheapest_layers_first(model: GatedModel, seqs: Sequence[Seq]) -> list[int]:
    """Layers by the agreement the model keeps when that layer alone is skipped, best first."""
    every = set(range(model.spec.num_layers))
    kept_alone = {i: continuation_agreement(model, list(seqs), every - {i}) for i in tqdm(every, desc="single skips")}
    return sorted(kept_alone, key=lambda i: -kept_alone[i])


def measure(model: GatedModel, train: list[Seq], held: list[Seq], study: Study) -> list[SkipRow]:
    every = set(range(model.spec.num_layers))
    order = list(study.order) or cheapest_layers_first(model, train)
    rows = []
    for count in study.skips:
        kept = every - set(order[:count])
        started = time.perf_counter()
        adapters = train_adapters(model, train, kept, study.rank, study.epochs)
        seconds = time.perf_counter() - started
        row = SkipRow(
            tuple(sorted(order[:count])),
            continuation_agreement(model, held, kept),
            adapted_agreement(model, held, kept, adapters),
            adapted_agreement(model, train, kept, adapters),
            seconds,
        )
        tqdm.write(f"{row}")  # a long run shows each skip set as it is measured
        rows.append(row)
    return rows


def main() -> None:
    parser = bench_parser(__doc__, threads_help="torch threads (default: 2)")
    parser.add_argument("--model", default="smollm2", help="a packaged model name or a model path")
    parser.add_argument("--skips", default="1,2,3,4", help="how many layers each skip set skips")
    parser.add_argument("--rank", type=int, default=8, help="adapter rank")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the training prompts per skip set")
    parser.add_argument("--spec-prompts", type=int, default=40, help="spec_prompts.jsonl prompts added to training")
    parser.add_argument("--train-tokens", type=int, default=48, help="greedy tokens per training continuation")
    parser.add_argument("--order", default="", help="layers in skipping order (default: measured, cheapest first)")
    parser.add_argument("--docstrings", type=int, default=0, help="standard-library docstrings added to training")
    args = parse_and_pin(parser)
    from adaptive_export.loading.model import load_model

    loaded = load_model(args.model)
    model = GatedModel(loaded).eval().requires_grad_(False)
    spec_prompts = load_prompts(ROOT / "samples" / "spec_prompts.jsonl")
    train_prompts = calibration_prompts(None) + spec_prompts[: args.spec_prompts]
    held_prompts = load_prompts(DEFAULT_PROMPTS) + spec_prompts[args.spec_prompts :]
    train = [Seq(*run) for run in greedy_sequences(loaded, train_prompts, args.train_tokens, "train")]
    train += shipped_text(loaded, args.docstrings)
    held = [Seq(*run) for run in greedy_sequences(loaded, held_prompts, HELD_OUT_TOKENS, "held-out")]
    study = Study(_ints(args.skips), args.rank, args.epochs, _ints(args.order))
    rows = measure(model, train, held, study)
    decode_rows = sum(len(s.ids) - s.prompt_len for s in train)
    print(
        f"\n{args.model}: {len(train)} training sequences ({decode_rows} decode rows) / {len(held)} held-out prompts,"
        f" rank {args.rank}, {args.epochs} epochs,"
    )
    print(f"quality floor {DEFAULT_MIN_AGREEMENT}, {cpu_model()}, {args.threads} threads\n")
    table = [
        {
            "skipped": ",".join(map(str, r.skipped)),
            "held-out without": f"{r.heldout_without:.3f}",
            "held-out with": f"{r.heldout_with:.3f}",
            "train with": f"{r.train_with:.3f}",
            "passes without": "yes" if r.heldout_without >= DEFAULT_MIN_AGREEMENT else "no",
            "passes with": "yes" if r.heldout_with >= DEFAULT_MIN_AGREEMENT else "no",
            "train s": r.train_seconds,
        }
        for r in rows
    ]
    print_table(table, list(table[0]))


def shipped_text(loaded: object, count: int) -> list[Seq]:
    """`count` docstrings as training sequences: a prompt of DOCSTRING_PROMPT tokens, the rest decode rows."""
    docs = stdlib_documents(loaded, count, DOCSTRING_TOKENS, seed=0)
    return [Seq(list(doc.ids), DOCSTRING_PROMPT) for doc in docs if len(doc.ids) > DOCSTRING_PROMPT + 1]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


if __name__ == "__main__":
    main()
