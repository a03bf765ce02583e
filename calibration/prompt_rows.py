"""Which rows each kind of prompt decodes on, measured by `build` on the built engines (issue #37).

Two-row passes speculate exactly (prompt lookup, growing its drafts, or an EAGLE head's guess) and
keep `--mode ar`'s tokens; whether they pay depends on what a pass of T rows costs against T=1 on
this CPU (T=2: 1.05 on Zen 4 with AVX-512 VNNI, 1.16-1.27 on Zen 3) and on how much of the answer
the drafts guess, which differs by model and by kind of prompt. So the build decodes the prompts of
samples/policy_prompts.jsonl (apart from the held-out benchmark sets) with the default run's
two-row decoder, counts its verify passes by rows, prices them with the engine's own pass costs,
and keeps two rows for a kind only where they cost at most TWO_ROWS_PAY one-row steps per token.
Counting and timing apart keeps the choice stable under a neighbour's load: greedy pass counts are
deterministic, and the pass costs are interleaved medians. The runtime reads the rows from the
manifest's `prompt_rows` (runtimes/decode_policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from adaptive_export.calibration.verify_cost import VerifyCosts, time_decode_passes
from adaptive_export.loading.prompts import read_prompts
from adaptive_export.runtimes.bundle import load_bundle
from adaptive_export.runtimes.decode_policy import prompt_kind
from adaptive_export.runtimes.drafting.prompt_lookup import GROWING_MOST
from adaptive_export.runtimes.generate import GenerationResult, Generator
from adaptive_export.runtimes.manifest_prompt_rows import PROMPT_KINDS

POLICY_PROMPTS = Path(__file__).resolve().parents[1] / "samples" / "policy_prompts.jsonl"
TWO_ROWS_PAY = 0.95  # two rows must save 5% per token: a one-shot run's noise band (issue #37)
NEW_TOKENS = 64  # per prompt: an edit answer's preamble and the start of the code it copies
MIN_NEW_TOKENS = 16  # a prompt measured with fewer (a small --max-len) would say little


@dataclass(frozen=True)
class KindCost:
    """One kind's two-row decoding: its verify passes by rows, over the tokens they emitted, priced
    in one-row steps per token (below 1: two rows pay)."""

    kind: str
    prompts: int
    tokens: int
    passes: dict[int, int]
    cost_per_token: float


@dataclass(frozen=True)
class PromptRowsChoice:
    """The rows per kind and what decided them: the manifest's `prompt_rows`."""

    rows: dict[str, int]
    costs: VerifyCosts
    kinds: list[KindCost]

    def to_json(self) -> dict[str, Any]:
        measured = {
            "pass_cost": {str(t): self.costs.cost(t - 1) for t in sorted(self.costs.pass_ms)},
            "cost_per_token": {k.kind: k.cost_per_token for k in self.kinds},
            "prompts": {k.kind: k.prompts for k in self.kinds},
            "tokens": {k.kind: k.tokens for k in self.kinds},
            "two_rows_pay_below": TWO_ROWS_PAY,
        }
        return {**self.rows, "measured": measured}


def pass_cost(costs: VerifyCosts, rows: int) -> float:
    """A pass of `rows` rows in T=1 passes; wider than timed (no default decoder makes one):
    extended by the last measured step."""
    widest = max(costs.pass_ms)
    if rows <= widest:
        return costs.cost(rows - 1)
    return costs.cost(widest - 1) + (rows - widest) * (costs.cost(widest - 1) - costs.cost(widest - 2))


def passes_by_rows(results: list[GenerationResult]) -> dict[int, int]:
    """The verify passes of these runs, counted by rows (`stats.speculation.passes_by_rows`)."""
    passes: dict[int, int] = {}
    for result in results:
        for rows, count in result.stats.speculation.get("passes_by_rows", {}).items():
            passes[int(rows)] = passes.get(int(rows), 0) + count
    return dict(sorted(passes.items()))


def kind_cost(kind: str, results: list[GenerationResult], costs: VerifyCosts) -> KindCost:
    """Price one kind's two-row runs: every verify pass at its measured cost, over the tokens the
    passes emitted (the first token comes from prefill on either path)."""
    passes = passes_by_rows(results)
    tokens = sum(max(0, result.stats.new_tokens - 1) for result in results)
    priced = sum(count * pass_cost(costs, rows) for rows, count in passes.items())
    cost = round(priced / tokens, 3) if tokens else 1.0
    return KindCost(kind, len(results), tokens, passes, cost)


def decode_fitting(generator: Generator, texts: list[str], new_tokens: int, bar: tqdm) -> list[GenerationResult]:
    """Each prompt decoded by the generator, up to new_tokens; a prompt the arena cannot hold with
    MIN_NEW_TOKENS of answer (a small --max-len) is left out."""
    results = []
    for text in texts:
        ids = generator.codec.encode(text)
        room = generator.bundle.max_len - len(ids)
        if room >= MIN_NEW_TOKENS:
            results.append(generator.generate(ids, max_new_tokens=min(new_tokens, room)))
        bar.update()
    return results


def calibrate_prompt_rows(
    bundle_dir: Path,
    prompts: list[str] | None = None,
    new_tokens: int = NEW_TOKENS,
    threads: int = 0,
    progress: bool = True,
) -> PromptRowsChoice:
    """Time the decode engine's passes up to growing lookup's widest (its drafts + 1), decode each
    prompt on two rows as the default run would, and choose each kind's rows."""
    texts = prompts if prompts is not None else read_prompts(str(POLICY_PROMPTS))
    generator = Generator(load_bundle(bundle_dir, verify="size"), decode_rows=2, threads=threads)
    costs = time_decode_passes(generator, GROWING_MOST)
    by_kind: dict[str, list[GenerationResult]] = {}
    with tqdm(total=len(texts), desc="measure prompt rows", unit="prompt", disable=not progress) as bar:
        for kind in PROMPT_KINDS:
            results = decode_fitting(generator, [t for t in texts if prompt_kind(t) == kind], new_tokens, bar)
            if results:
                by_kind[kind] = results
    kinds = [kind_cost(kind, results, costs) for kind, results in by_kind.items()]
    rows = {k.kind: 2 if k.cost_per_token <= TWO_ROWS_PAY else 1 for k in kinds}  # no tokens: cost 1.0
    return PromptRowsChoice(rows, costs, kinds)
