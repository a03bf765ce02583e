"""Calibration measurements in PyTorch on the model's own greedy continuations.

Every draft source is simulated exactly as the runtime runs it (greedy; the per-source
measures are in calibration/drafts/): while drafts are accepted they equal the
true tokens, so early-exit drafts are the teacher-forced early-exit predictions, and a
round ends at the first mismatch with the verifier's token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from adaptive_export.calibration.drafts import MEASURES
from adaptive_export.calibration.greedy import greedy_runs_with_hidden
from adaptive_export.loading.prompts import read_prompts
from adaptive_export.runtimes.errors import UsageError

BUILTIN_CALIB = Path(__file__).resolve().parents[1] / "samples" / "calib_prompts.jsonl"


def calibration_prompts(path: str | None) -> list[str]:
    if path is None:
        if not BUILTIN_CALIB.is_file():
            raise UsageError("the built-in calibration prompts are missing", "pass --calib FILE.jsonl")
        path = str(BUILTIN_CALIB)
    return read_prompts(path)


def measure_speculation(
    loaded: Any,
    parts: Any,
    prompts: list[str],
    new_tokens: int,
    adapters: dict[int, Any] | None = None,
    runs: list[tuple[list[int], list[int], Any]] | None = None,
) -> dict[str, Any]:
    """Simulate every draft source (calibration/drafts/) on the same greedy runs; with
    `adapters` the early-exit candidates are their exits and the drafts go through them
    (head(adapter(h_E))), as the draft engine computes them. `runs` reuses greedy_runs_with_hidden
    results already generated for `prompts`."""
    import torch

    measures = [measure(loaded, adapters) for measure in MEASURES.values()]
    if runs is None:
        runs = greedy_runs_with_hidden(loaded, prompts, new_tokens)
    for ids, cont, hidden in tqdm(runs, total=len(prompts), desc="calibrate speculation", unit="prompt"):
        if len(cont) < 2:
            continue
        with torch.no_grad():
            for measure in measures:
                measure.observe(ids, cont, hidden)
    layer_params = sum(p.numel() for p in loaded.hf_model.model.layers[0].parameters())
    head_params = loaded.hf_model.lm_head.weight.numel()
    report: dict[str, Any] = {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "head_cost_layers": round(head_params / layer_params, 3),
        "adapter_cost_layers": round(
            max((sum(p.numel() for p in a.parameters()) for a in (adapters or {}).values()), default=0) / layer_params,
            4,
        ),
    }
    for measure in measures:
        report.update(measure.report())
    return report
