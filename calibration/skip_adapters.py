"""FiRST's LoRA compensation for skipped layers (`build --routers train --lora R`).

A skip configuration's decode graph may add, after every kept layer, a low-rank residual
adapter h -> h + up(silu(down(norm(h)))) (graphs/adaptive.py's ExitAdapter form: two small
MatMuls per layer). The adapters are one shared set, one per layer, trained once by
self-distillation toward the full model with the backbone frozen, each training step decoding
with one of the kept sets the routers chose, so every compiled configuration reads the same
tensors (weights stored once) and each configuration uses its kept layers' adapters.

Semantics are the runtime's: prefill (prompt rows) runs every layer unadapted; decode
(continuation rows) bypasses the skipped layers and adapts the output of every kept one, so
the decode rows' keys and values are computed from adapted states, as the engine computes them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence, Set
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm import tqdm

from adaptive_export.calibration.routers import GatedModel, TrainingSequence, skipping_logits
from adaptive_export.graphs.adaptive import ExitAdapter

LEARNING_RATE = 2e-3
EPOCHS = 3


@dataclass(frozen=True)
class AdapterTraining:
    """The shared adapters and how they were trained (calibration.json's record)."""

    adapters: dict[int, ExitAdapter]
    rank: int
    epochs: int
    steps: int
    decode_rows: int
    seconds: float
    kept_sets: int
    seed: int


def adapted_logits(model: GatedModel, seq: TrainingSequence, kept: Set[int], adapters: nn.ModuleDict) -> Tensor:
    """Logits of the continuation rows' predictions (positions prompt_len-1 .. end-1) when decoding
    skips the layers outside `kept` and adapts every kept layer's output; gradients reach the adapters."""
    x, frame, empty = model._start(seq.ids)
    decoding = (torch.arange(len(seq.ids)) >= seq.prompt_len)[:, None]
    for index, layer in enumerate(model.layers):
        out, _, _ = layer(x, empty, empty, *frame[index])
        x = torch.where(decoding, adapters[str(index)](out), out) if index in kept else torch.where(decoding, x, out)
    return model.head(x)[seq.prompt_len - 1 : -1]


def adapted_agreement(
    model: GatedModel, sequences: Sequence[TrainingSequence], kept: Set[int], adapters: nn.ModuleDict
) -> float:
    """Teacher-forced top-1 agreement with the full model's greedy continuation, adapters in place
    (calibration/routers.py's `continuation_agreement` without them)."""
    hits = total = 0
    with torch.no_grad():
        for seq in sequences:
            predicted = adapted_logits(model, seq, kept, adapters).argmax(-1)
            hits += int((predicted == torch.tensor(seq.ids[seq.prompt_len :])).sum())
            total += len(seq.ids) - seq.prompt_len
    return hits / max(total, 1)


def new_adapters(model: GatedModel, rank: int, layers: Set[int], seed: int) -> nn.ModuleDict:
    """Identity adapters (`up` starts at zero) for `layers`, seeded."""
    spec = model.spec
    torch.manual_seed(seed)
    return nn.ModuleDict({str(i): ExitAdapter(spec.hidden_size, rank, spec.rms_norm_eps) for i in sorted(layers)})


def train_skip_adapters(
    model: GatedModel,
    sequences: Sequence[TrainingSequence],
    kept_sets: Sequence[frozenset[int]],
    rank: int,
    epochs: int = EPOCHS,
    seed: int = 0,
    progress: bool = True,
) -> AdapterTraining:
    """One adapter per layer, trained toward the full model's log-probabilities; each step decodes
    one sequence with one of `kept_sets` (in turn, so every set gets its share of the text)."""
    every = frozenset(range(model.spec.num_layers))
    adapters = new_adapters(model, rank, every, seed)
    optimizer = torch.optim.Adam(adapters.parameters(), lr=LEARNING_RATE)
    order = torch.Generator().manual_seed(seed)
    started, steps = time.perf_counter(), 0
    bar = tqdm(total=epochs * len(sequences), desc=f"skip adapters (rank {rank})", unit="seq", disable=not progress)
    for _ in range(epochs):
        for index in torch.randperm(len(sequences), generator=order).tolist():
            seq, kept = sequences[index], kept_sets[steps % len(kept_sets)]
            # the teacher is recomputed, not stored: Gemma 3's 262k-token rows would take GBs
            teacher = torch.log_softmax(skipping_logits(model, seq.ids, seq.prompt_len, every), -1)
            student = torch.log_softmax(adapted_logits(model, seq, kept, adapters), -1)
            loss = nn.functional.kl_div(
                student, teacher[seq.prompt_len - 1 : -1], log_target=True, reduction="batchmean"
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            bar.update(1)
            bar.set_postfix(kl=f"{loss.item():.3f}")
    bar.close()
    adapters.eval().requires_grad_(False)
    return AdapterTraining(
        adapters={int(k): v for k, v in adapters.items()},  # type: ignore[misc]
        rank=rank,
        epochs=epochs,
        steps=steps,
        decode_rows=epochs * sum(len(s.ids) - s.prompt_len for s in sequences),
        seconds=time.perf_counter() - started,
        kept_sets=len(set(kept_sets)),
        seed=seed,
    )


def as_module_dict(adapters: dict[int, ExitAdapter]) -> nn.ModuleDict:
    """The per-layer adapters keyed as `adapted_logits` reads them."""
    return nn.ModuleDict({str(layer): adapter for layer, adapter in adapters.items()})
