"""Train a draft exit: exit block + VocabTrim head, by self-distillation (`build --draft-head train`).

Why: the raw early exit rarely agrees with the full model, and every draft step pays the whole
LM head. The draft here is head_N(block(h_E)): a trained block of at most one decoder layer's
parameters (graphs.adaptive.ExitAdapter at a large rank, or GatedExitAdapter), the shared final
norm, and the LM head's rows of the N token ids the teacher writes most often (VocabTrim), so a
draft step pays about E layers + one layer.

Recipe (docs/early-exit.md "Trained draft exit"):
- text: calibration/draft_data.py (the model's own requests and answers, stdlib docstrings),
  whole documents held out;
- the frozen backbone runs ONCE per document, teacher-forced: h_E per exit and the full model's
  top-k distribution are cached (`teacher_cache`);
- the block trains with KL to the teacher's top-k restricted to the trimmed vocabulary
  (`trimmed_kl`), under `accelerate` (one process here, `accelerate launch` for several GPUs);
- agreement on held-out positions counts a miss whenever the teacher's argmax lies outside the
  trimmed vocabulary; the better form per E is kept;
- dynamic draft length (calibration/draft_length.py) picks the confidence threshold.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from adaptive_export.calibration.draft_data import Document, TrainingText
from adaptive_export.calibration.draft_length import Costs, choose_length
from adaptive_export.calibration.draft_vocab import ranked_ids
from adaptive_export.graphs.adaptive import DraftHead, ExitAdapter, GatedExitAdapter
from adaptive_export.graphs.layers import Head

TOP_K = 64
BATCH = 64
LR = 1e-3
WEIGHT_DECAY = 1e-4
EVAL_BATCH = 1024
FORMS = ("lowrank", "gated")
VOCAB_SIZES = (2048, 4096, 8192)


@dataclass(frozen=True)
class Cached:
    """One split, teacher-forced once: h_E per exit, the teacher's top-k, and where greedy runs lie."""

    hidden: dict[int, Tensor]  # exit -> [N, H]
    top_ids: Tensor  # [N, TOP_K]; column 0 is the teacher's argmax
    top_logp: Tensor  # [N, TOP_K]
    segment: Tensor  # [N] document index where the position's next token is the teacher's own greedy token, else -1

    @property
    def size(self) -> int:
        return int(self.top_ids.shape[0])


def teacher_cache(
    loaded: Any, docs: Sequence[Document], exits: Sequence[int], seen: set[int], progress: bool
) -> Cached:
    """Run the frozen model over each document once; keep positions whose prefix is new (the chat
    template's shared system prompt would otherwise dominate and leak into the held-out split)."""
    hidden: dict[int, list[Tensor]] = {e: [] for e in exits}
    ids, logp, segment = [], [], []
    with torch.no_grad():
        for index, doc in enumerate(tqdm(docs, desc="teacher pass", unit="doc", disable=not progress)):
            fresh = []
            for t in range(len(doc.ids)):
                key = hash(doc.ids[: t + 1])
                if key not in seen:
                    seen.add(key)
                    fresh.append(t)
            if not fresh:
                continue
            out = loaded.hf_model(torch.tensor([doc.ids]), output_hidden_states=True)
            keep = torch.tensor(fresh, dtype=torch.long)
            for e in exits:
                hidden[e].append(out.hidden_states[e][0, keep].float())
            top = torch.log_softmax(out.logits[0, keep].float(), dim=-1).topk(TOP_K, dim=-1)
            ids.append(top.indices)
            logp.append(top.values)
            own = [index if doc.answer_start - 1 <= t < len(doc.ids) - 1 else -1 for t in fresh]
            segment.append(torch.tensor(own, dtype=torch.long))
    width = loaded.spec.hidden_size
    return Cached(
        {e: torch.cat(v) if v else torch.zeros(0, width) for e, v in hidden.items()},
        torch.cat(ids) if ids else torch.zeros(0, TOP_K, dtype=torch.long),
        torch.cat(logp) if logp else torch.zeros(0, TOP_K),
        torch.cat(segment) if segment else torch.zeros(0, dtype=torch.long),
    )


def layer_params(loaded: Any) -> int:
    return sum(p.numel() for p in loaded.hf_model.model.layers[0].parameters())


def make_block(form: str, hidden_size: int, eps: float, budget: int) -> nn.Module:
    """The largest block of `form` within `budget` parameters (one decoder layer's worth)."""
    if form == "lowrank":  # 2 * H * rank + H
        return ExitAdapter(hidden_size, max(1, (budget - hidden_size) // (2 * hidden_size)), eps)
    if form == "gated":  # 3 * H * width + H, width capped at the model's own MLP-like 8/3 H
        width = min((budget - hidden_size) // (3 * hidden_size), (8 * hidden_size) // 3)
        return GatedExitAdapter(hidden_size, max(1, width), eps)
    raise ValueError(f"unknown exit block form {form!r} (one of {FORMS})")


class TrimmedDraft(nn.Module):
    """block -> final norm -> the trimmed head rows: what the draft engine computes. The norm and
    rows are frozen copies (buffers), so preparing this module never moves the HF model."""

    def __init__(self, block: nn.Module, head: Head, ids: Tensor) -> None:
        super().__init__()
        self.block = block
        self.eps = head.eps
        self.register_buffer("norm_weight", head.arch.norm_weight(head.norm).detach().float().clone())
        self.register_buffer("rows", head.lm_head.weight.detach().float().index_select(0, ids).clone())

    def forward(self, h: Tensor) -> Tensor:
        x = self.block(h)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return nn.functional.linear(x, self.rows)


def trimmed_kl(logits: Tensor, top_index: Tensor, top_logp: Tensor) -> Tensor:
    """Mean over positions of sum p_j (log p_j - log q_j) over the teacher's top-k tokens that the
    trimmed head can name (`top_index` >= 0: their row); p the teacher's true probabilities."""
    named = top_index >= 0
    logq = torch.log_softmax(logits, dim=-1).gather(-1, top_index.clamp(min=0))
    return (top_logp.exp() * (top_logp - logq) * named).sum(-1).mean()


def row_of(ids: Tensor, vocab: int) -> Tensor:
    """vocab -> row of the trimmed head, -1 for ids it cannot name."""
    rows = torch.full((vocab,), -1, dtype=torch.long)
    rows[ids] = torch.arange(ids.numel())
    return rows


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 6
    max_seconds: float = 240.0  # per (exit, form): the whole SmolLM2 recipe stays within 20 minutes on 2 cores
    seed: int = 0
    lr: float = LR
    progress: bool = True


def train_block(draft: TrimmedDraft, hidden: Tensor, top_index: Tensor, top_logp: Tensor, settings: TrainSettings,
                label: str) -> dict[str, Any]:  # fmt: skip
    """AdamW with cosine decay over shuffled minibatches, under accelerate; trains draft.block in place."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(settings.seed)
    accelerator = Accelerator()
    loader = DataLoader(
        TensorDataset(hidden, top_index, top_logp),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(settings.seed),
    )
    optimizer = torch.optim.AdamW(draft.block.parameters(), lr=settings.lr, weight_decay=WEIGHT_DECAY)
    model, optimizer, loader = accelerator.prepare(draft, optimizer, loader)
    total_steps = settings.epochs * len(loader)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total_steps)))
    started, steps, losses = time.perf_counter(), 0, []
    bar = tqdm(
        total=total_steps,
        desc=f"train {label}",
        unit="step",
        disable=not (settings.progress and accelerator.is_main_process),
    )
    model.train()
    for _ in range(settings.epochs):
        for batch_hidden, batch_index, batch_logp in loader:
            loss = trimmed_kl(model(batch_hidden), batch_index, batch_logp)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            schedule.step()
            steps += 1
            losses.append(loss.item())
            bar.update(1)
            if steps % 20 == 0:
                bar.set_postfix(kl=round(sum(losses[-20:]) / 20, 4))
            if time.perf_counter() - started > settings.max_seconds:
                break
        if time.perf_counter() - started > settings.max_seconds:
            break
    bar.close()
    accelerator.unwrap_model(model).eval().cpu()
    return {
        "steps": steps,
        "of_steps": total_steps,
        "final_kl": round(sum(losses[-20:]) / max(len(losses[-20:]), 1), 4),
    }


def predictions(draft: TrimmedDraft, hidden: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """(token id of each position's draft, the draft's own top-1 probability)."""
    tokens, confidence = [], []
    with torch.no_grad():
        for start in range(0, hidden.shape[0], EVAL_BATCH):
            probs = torch.softmax(draft(hidden[start : start + EVAL_BATCH]), dim=-1)
            best = probs.max(-1)
            tokens.append(ids[best.indices])
            confidence.append(best.values)
    if not tokens:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0)
    return torch.cat(tokens), torch.cat(confidence)


def trimmed_agreement(draft: TrimmedDraft, hidden: Tensor, ids: Tensor, teacher_argmax: Tensor) -> float:
    """Share of positions where the trimmed draft names the teacher's argmax (outside the trim: a miss)."""
    if hidden.shape[0] == 0:
        return float("nan")
    return float((predictions(draft, hidden, ids)[0] == teacher_argmax).float().mean())


def raw_agreement(head: Head, hidden: Tensor, teacher_argmax: Tensor) -> float:
    """The untrained exit: the shared head over the whole vocabulary on h_E."""
    if hidden.shape[0] == 0:
        return float("nan")
    with torch.no_grad():
        hits = sum(
            int((head(hidden[s : s + EVAL_BATCH]).argmax(-1) == teacher_argmax[s : s + EVAL_BATCH]).sum())
            for s in range(0, hidden.shape[0], EVAL_BATCH)
        )
    return hits / hidden.shape[0]


def vocabulary_order(loaded: Any, text: TrainingText, train: Cached) -> Tensor:
    """Every token id, most useful first: special ids, then by the teacher's argmax frequency on the
    training text, then by frequency in that text, then by id."""
    teacher = Counter(int(t) for t in train.top_ids[:, 0])
    written = Counter(t for doc in text.train for t in doc.ids)
    special = getattr(loaded.tokenizer, "all_special_ids", None) or []
    return torch.tensor(ranked_ids(special, teacher, written, loaded.spec.vocab_size), dtype=torch.long)


def trimmed_ids(order: Tensor, size: int) -> Tensor:
    """The `size` most useful ids, ascending (draft_vocab.bin's order)."""
    return order[:size].sort().values


def minutes_since(wall: float, cpu: float) -> dict[str, float]:
    """Wall and process CPU minutes since (perf_counter, process_time) readings: the machine is shared."""
    return {"wall": round((time.perf_counter() - wall) / 60, 2), "cpu": round((time.process_time() - cpu) / 60, 2)}


def agreement_at(block: nn.Module, exit_layer: int, context: ExitContext, size: int) -> float:
    """Held-out agreement of head_size(block(h_E)) with the teacher's argmax."""
    ids = trimmed_ids(context.order, size)
    value = trimmed_agreement(TrimmedDraft(block, context.head, ids), context.held.hidden[exit_layer], ids,
                              context.held.top_ids[:, 0])  # fmt: skip
    return round(value, 4)


@dataclass(frozen=True)
class DraftHeadFit:
    heads: dict[int, DraftHead]
    report: dict[str, Any]


def draft_exits(num_layers: int) -> list[int]:
    """L/2, 2L/3, 5L/6: the exits a trained draft is tried at."""
    return sorted({e for e in (num_layers // 2, (2 * num_layers) // 3, (5 * num_layers) // 6) if 0 < e < num_layers})


def held_out_segments(
    draft: TrimmedDraft, held: Cached, exit_layer: int, ids: Tensor
) -> list[tuple[list[bool], list[float]]]:
    """Per held-out greedy run, each position's (draft names the teacher's argmax, draft confidence)."""
    tokens, confidence = predictions(draft, held.hidden[exit_layer], ids)
    correct = (tokens == held.top_ids[:, 0]).tolist()
    out = []
    for segment in sorted(set(held.segment.tolist()) - {-1}):
        where = (held.segment == segment).nonzero().flatten().tolist()
        out.append(([correct[i] for i in where], [float(confidence[i]) for i in where]))
    return out


def costs_at(loaded: Any, exit_layer: int, block: nn.Module, size: int) -> Costs:
    spec, per_layer = loaded.spec, layer_params(loaded)
    full_head = spec.vocab_size * spec.hidden_size / per_layer
    block_cost = sum(p.numel() for p in block.parameters()) / per_layer
    return Costs(
        draft=exit_layer + block_cost + size * spec.hidden_size / per_layer,
        verify=spec.num_layers - exit_layer + full_head,
        plain=spec.num_layers + full_head,
    )


def train_form(
    form: str, exit_layer: int, context: ExitContext, settings: TrainSettings
) -> tuple[nn.Module, dict[str, Any]]:
    """Train one block form at one exit; its held-out agreement per vocabulary size."""
    loaded, train = context.loaded, context.train
    spec = loaded.spec
    block = make_block(form, spec.hidden_size, spec.rms_norm_eps, layer_params(loaded))
    largest = trimmed_ids(context.order, max(context.sizes))
    top_index = row_of(largest, spec.vocab_size)[train.top_ids]
    wall, cpu = time.perf_counter(), time.process_time()
    details = train_block(TrimmedDraft(block, context.head, largest), train.hidden[exit_layer], top_index,
                          train.top_logp, settings, f"{form} E={exit_layer}")  # fmt: skip
    agreement = {str(n): agreement_at(block, exit_layer, context, n) for n in context.sizes}
    return block, {
        "params": sum(p.numel() for p in block.parameters()),
        "held_out_agreement": agreement,
        "train_minutes": minutes_since(wall, cpu),
        **details,
    }  # fmt: skip


@dataclass(frozen=True)
class ExitContext:
    """What every exit's training shares: the model, its head, both cached splits, the id order."""

    loaded: Any
    head: Head
    train: Cached
    held: Cached
    order: Tensor
    sizes: tuple[int, ...]


def fit_exit(
    exit_layer: int, context: ExitContext, forms: Sequence[str], settings: TrainSettings
) -> tuple[DraftHead, dict[str, Any]]:
    """Every form at this exit; keep the one with the best held-out agreement at the largest vocabulary,
    then the vocabulary size, draft length and stop threshold with the best expected speed-up."""
    teacher, hidden = context.held.top_ids[:, 0], context.held.hidden[exit_layer]
    report: dict[str, Any] = {
        "untrained_agreement": {
            "full_vocabulary": round(raw_agreement(context.head, hidden, teacher), 4),
            **{str(n): agreement_at(nn.Identity(), exit_layer, context, n) for n in context.sizes},
        },
        "forms": {},
    }
    blocks = {}
    for form in forms:
        blocks[form], report["forms"][form] = train_form(form, exit_layer, context, settings)
    largest = str(max(context.sizes))
    form = max(forms, key=lambda f: report["forms"][f]["held_out_agreement"][largest])
    choices = {}
    for n in context.sizes:
        ids = trimmed_ids(context.order, n)
        segments = held_out_segments(TrimmedDraft(blocks[form], context.head, ids), context.held, exit_layer, ids)
        choices[n] = choose_length(segments, costs_at(context.loaded, exit_layer, blocks[form], n))
    size = max(choices, key=lambda n: choices[n].expected_speedup)
    best = choices[size]
    report["kept"] = {
        "form": form,
        "vocab": size,
        "draft_len": best.draft_len,
        "stop_below": best.stop_below,
        "tokens_per_round": round(best.rounds.tokens_per_round, 3),
        "acceptance": round(best.rounds.accepted / max(best.rounds.drafted, 1), 4),
        "expected_speedup": round(best.expected_speedup, 3),
        "expected_speedup_fixed_length": round(best.fixed_speedup, 3),
        "per_vocab_expected_speedup": {str(n): round(c.expected_speedup, 3) for n, c in choices.items()},
    }
    head = DraftHead(exit_layer, form, blocks[form], trimmed_ids(context.order, size), best.draft_len, best.stop_below)
    return head, report


def train_draft_heads(
    loaded: Any,
    text: TrainingText,
    exits: Sequence[int],
    *,
    sizes: Sequence[int] = VOCAB_SIZES,
    forms: Sequence[str] = FORMS,
    settings: TrainSettings = TrainSettings(),
) -> DraftHeadFit:
    """One trained draft exit per exit layer; the report holds every measured number."""
    spec = loaded.spec
    sizes = tuple(sorted({min(n, spec.vocab_size - 1) for n in sizes}))
    wall, cpu = time.perf_counter(), time.process_time()
    seen: set[int] = set()  # train first: a held-out prefix already in train is not held out
    train = teacher_cache(loaded, text.train, exits, seen, settings.progress)
    held = teacher_cache(loaded, text.held_out, exits, seen, settings.progress)
    teacher_minutes = {
        "wall": round((time.perf_counter() - wall) / 60, 2),
        "cpu": round((time.process_time() - cpu) / 60, 2),
    }
    context = ExitContext(
        loaded, Head(loaded.hf_model, spec), train, held, vocabulary_order(loaded, text, train), sizes
    )
    heads, per_exit = {}, {}
    for e in exits:
        heads[e], per_exit[str(e)] = fit_exit(e, context, forms, settings)
    report = {
        "text": text.summary(),
        "positions": {"train": train.size, "held_out": held.size, "held_out_greedy": int((held.segment >= 0).sum())},
        "top_k_target": TOP_K,
        "loss": "KL(teacher || trimmed draft) over the teacher's top-k tokens the trimmed head names",
        "layer_params": layer_params(loaded),
        "seed": settings.seed,
        "epochs": settings.epochs,
        "teacher_minutes": teacher_minutes,
        "minutes": minutes_since(wall, cpu),
        "per_exit": per_exit,
    }
    return DraftHeadFit(heads, report)
