"""Calibration measurements in PyTorch on the model's own greedy continuations.

Both draft sources are simulated exactly as the runtime runs them (greedy): while drafts
are accepted they equal the true tokens, so early-exit drafts are the teacher-forced
early-exit predictions, and a round ends at the first mismatch with the verifier's token.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from loading.prompts import read_prompts
from runtimes.errors import UsageError
from runtimes.speculative import lookup_ngram

BUILTIN_CALIB = Path(__file__).resolve().parents[1] / "samples" / "calib_prompts.jsonl"
MAX_DRAFT = 8


def calibration_prompts(path: str | None) -> list[str]:
    if path is None:
        if not BUILTIN_CALIB.is_file():
            raise UsageError("the built-in calibration prompts are missing", "pass --calib FILE.jsonl")
        path = str(BUILTIN_CALIB)
    return read_prompts(path)


def greedy_sequence(loaded: Any, prompt: str, new_tokens: int) -> tuple[list[int], int]:
    """(prompt ids + the full model's greedy continuation, prompt length)."""
    ids, cont, _ = greedy_with_hidden(loaded, prompt, new_tokens, hidden=False)
    return ids + cont, len(ids)


def greedy_with_hidden(loaded: Any, prompt: str, new_tokens: int, hidden: bool = True) -> tuple[list[int], list[int], Any]:
    """(prompt ids, greedy continuation, hidden states of prompt+continuation per layer)."""
    import torch

    tok, model = loaded.tokenizer, loaded.hf_model
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    else:
        ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id or 0)
        full = out[0].tolist()
        states = model(torch.tensor([full]), output_hidden_states=True).hidden_states if hidden else None
    return ids, full[len(ids):], states


def simulate_rounds(drafts_at: Any, truth: list[int], k: int, bonus: bool = False) -> dict[str, float]:
    """Greedy speculation over `truth`; drafts_at(i, k) proposes tokens for positions i+1..

    `bonus`: the verifier also scores the last draft, so a round where every draft is
    accepted emits one more token (prompt lookup; early exit would need one more draft call).
    """
    i, rounds, drafted, accepted, hits = 0, 0, 0, 0, 0
    while i < len(truth) - 1:
        drafts = drafts_at(i, k)[: len(truth) - 1 - i]
        rounds += 1
        if not drafts:
            i += 1
            continue
        hits += 1
        good = 0
        while good < len(drafts) and drafts[good] == truth[i + 1 + good]:
            good += 1
        drafted += len(drafts)
        accepted += good
        i += good + (1 if good < len(drafts) or bonus else 0)
    produced = len(truth) - 1
    return {"rounds": rounds, "tokens_per_round": produced / max(rounds, 1), "acceptance": accepted / max(drafted, 1),
            "hit_rate": hits / max(rounds, 1)}


def measure_speculation(loaded: Any, parts: Any, prompts: list[str], new_tokens: int, adapters: dict[int, Any] | None = None,
                        runs: list[tuple[list[int], list[int], Any]] | None = None) -> dict[str, Any]:
    """Simulate both draft sources; with `adapters` the early-exit candidates are their exits and the
    drafts go through them (head(adapter(h_E))), as the draft engine computes them. `runs` reuses
    greedy_with_hidden results already generated for `prompts`."""
    import torch

    from graphs.layers import Head

    spec = loaded.spec
    head = Head(loaded.hf_model, spec)
    candidates = sorted(adapters) if adapters else list(range(max(1, spec.num_layers // 3), spec.num_layers))
    draft_in = (lambda e, h: adapters[e](h)) if adapters else (lambda e, h: h)
    per_exit = {e: [] for e in candidates}
    lookup = {k: [] for k in range(1, MAX_DRAFT + 1)}
    early = {(e, k): [] for e in candidates for k in (1, 2, 3, 4, 6, 8)}
    if runs is None:
        runs = (greedy_with_hidden(loaded, prompt, new_tokens) for prompt in prompts)
    for ids, cont, hidden in tqdm(runs, total=len(prompts), desc="calibrate speculation", unit="prompt"):
        if len(cont) < 2:
            continue
        start = len(ids) - 1  # position whose output predicts cont[0]
        truth = cont
        with torch.no_grad():
            # hidden[e] is the input of layer e (un-normalised); HF's last entry is already
            # normalised, so the reference is the greedy continuation itself.
            for e in candidates:
                pred = head(draft_in(e, hidden[e][0, start : start + len(cont)])).argmax(-1).tolist()
                per_exit[e].append(float(np.mean([p == t for p, t in zip(pred, truth)])))
                for k in (1, 2, 3, 4, 6, 8):
                    # the draft at position i (after token truth[i]) is pred[i + 1]
                    early[(e, k)].append(simulate_rounds(lambda i, kk, pred=pred: pred[i + 1 : i + 1 + kk], truth, k))
        context = list(ids)
        for k in lookup:
            lookup[k].append(simulate_rounds(lambda i, kk: lookup_ngram(context + truth[: i + 1], kk), truth, k, bonus=True))
    layer_params = sum(p.numel() for p in loaded.hf_model.model.layers[0].parameters())
    head_params = loaded.hf_model.lm_head.weight.numel()

    def mean(rows: list[dict[str, float]], key: str) -> float:
        return round(float(np.mean([r[key] for r in rows])), 4) if rows else 0.0

    agreement = {str(e): round(float(np.mean(v)), 4) for e, v in per_exit.items() if v}
    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "head_cost_layers": round(head_params / layer_params, 3),
        "adapter_cost_layers": round(max((sum(p.numel() for p in a.parameters()) for a in (adapters or {}).values()), default=0) / layer_params, 4),
        "early_exit_agreement": agreement,
        "early_exit_through_adapter": bool(adapters),
        "best_exit_layer": int(max(agreement, key=agreement.get)) if agreement else spec.num_layers - 1,
        "early_exit_tokens_per_round": {f"{e}:{k}": mean(v, "tokens_per_round") for (e, k), v in early.items()},
        "prompt_lookup_acceptance": {str(k): mean(v, "acceptance") for k, v in lookup.items()},
        "prompt_lookup_hit_rate": {str(k): mean(v, "hit_rate") for k, v in lookup.items()},
        "prompt_lookup_tokens_per_round": {str(k): mean(v, "tokens_per_round") for k, v in lookup.items()},
    }
