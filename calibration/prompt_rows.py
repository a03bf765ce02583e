"""Which rows and decoder each kind of prompt decodes with, measured by `build` on the built engines.

Two-row passes speculate exactly and keep `--mode ar`'s tokens, in two ways: `--mode ar`'s floor
rounds (every pass T=2 over the pending token and a free guess: prompt lookup's next token or an
EAGLE head's) and the default's growing lookup (drafts growing from the tokens, passes up to
GROWING_MOST + 1 rows). Whether either pays depends on what a pass of T rows costs against T=1 on
this CPU (T=2: 1.05 on Zen 4 with AVX-512 VNNI, 1.16-1.27 on Zen 3 with MatMulNBits) and on how
much of the answer the guesses get right, which differs by model and by kind of prompt. So the
build decodes the prompts of samples/policy_prompts.jsonl (apart from the held-out benchmark sets)
with both decoders, counts their passes by rows, prices them with the engine's own pass costs and
chooses per kind (runtimes/rows_choice.py). Counting and timing apart keeps the choice stable
under a neighbour's load (greedy counts are deterministic, the pass costs interleaved medians), and
lets a machine other than this one make it again with its own pass costs (runtimes/rows_recheck.py).
The manifest's `prompt_rows` records the choice, the counts and this machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from adaptive_export.calibration.verify_cost import time_decode_passes
from adaptive_export.loading.prompts import read_prompts
from adaptive_export.runtimes.bundle import load_bundle
from adaptive_export.runtimes.decode_policy import prompt_kind
from adaptive_export.runtimes.drafting.prompt_lookup import GROWING_MOST
from adaptive_export.runtimes.generate import GenerationResult, Generator
from adaptive_export.runtimes.machine import MachineId, this_machine
from adaptive_export.runtimes.manifest_prompt_rows import PROMPT_KINDS
from adaptive_export.runtimes.pass_costs import VerifyCosts
from adaptive_export.runtimes.rows_choice import GROWING_PAYS, TWO_ROWS_PAY, KindChoice, KindCounts, choose

POLICY_PROMPTS = Path(__file__).resolve().parents[1] / "samples" / "policy_prompts.jsonl"
NEW_TOKENS = 64  # per prompt: an edit answer's preamble and the start of the code it copies
MIN_NEW_TOKENS = 16  # a prompt measured with fewer (a small --max-len) would say little


@dataclass(frozen=True)
class PromptRowsChoice:
    """The choice per kind and what decided it: the manifest's `prompt_rows`."""

    choices: list[KindChoice]
    counts: list[KindCounts]
    costs: VerifyCosts
    machine: MachineId

    @property
    def rows(self) -> dict[str, int]:
        return {c.kind: c.rows for c in self.choices}

    def to_json(self) -> dict[str, Any]:
        decoders = {c.kind: c.decoder for c in self.choices if c.rows == 2}
        measured = {
            "pass_cost": {str(t): self.costs.cost(t - 1) for t in sorted(self.costs.pass_ms)},
            "cost_per_token": {c.kind: c.growing_cost for c in self.choices},
            "floor_cost_per_token": {c.kind: c.floor_cost for c in self.choices},
            "prompts": {k.kind: k.prompts for k in self.counts},
            "tokens": {k.kind: k.tokens for k in self.counts},
            "floor_tokens": {k.kind: k.floor_tokens for k in self.counts},
            "passes": {k.kind: {"growing": _keyed(k.growing), "floor": _keyed(k.floor)} for k in self.counts},
            "two_rows_pay_below": TWO_ROWS_PAY,
            "growing_pays_below": GROWING_PAYS,
            "machine": self.machine.to_json(),
        }
        return {**self.rows, "decoders": decoders, "measured": measured}


def _keyed(passes: dict[int, int]) -> dict[str, int]:
    return {str(rows): count for rows, count in sorted(passes.items())}


def passes_by_rows(results: list[GenerationResult]) -> dict[int, int]:
    """The verify passes of these runs, counted by rows (`stats.speculation.passes_by_rows`)."""
    passes: dict[int, int] = {}
    for result in results:
        for rows, count in result.stats.speculation.get("passes_by_rows", {}).items():
            passes[int(rows)] = passes.get(int(rows), 0) + count
    return dict(sorted(passes.items()))


def emitted(results: list[GenerationResult]) -> int:
    """Tokens the decode passes emitted (the first comes from prefill on every path)."""
    return sum(max(0, result.stats.new_tokens - 1) for result in results)


def decode_fitting(generator: Generator, ids: list[list[int]], new_tokens: int, mode: str) -> list[GenerationResult]:
    """Each prompt decoded up to new_tokens under `mode` (its rows are the generator's)."""
    room = generator.bundle.max_len
    return [generator.generate(p, max_new_tokens=min(new_tokens, room - len(p)), mode=mode) for p in ids]


def kind_counts(generator: Generator, kind: str, ids: list[list[int]], new_tokens: int) -> KindCounts:
    """One kind's passes under the default's two-row decoder and under `--mode ar`'s."""
    growing = decode_fitting(generator, ids, new_tokens, "auto")
    floor = decode_fitting(generator, ids, new_tokens, "ar")  # near-ties may end it elsewhere: its own count
    return KindCounts(kind, len(ids), emitted(growing), passes_by_rows(growing), passes_by_rows(floor), emitted(floor))


def fitting_ids(generator: Generator, texts: list[str]) -> list[list[int]]:
    """The prompts' ids; a prompt the arena cannot hold with MIN_NEW_TOKENS of answer is left out."""
    ids = [generator.codec.encode(text) for text in texts]
    return [p for p in ids if generator.bundle.max_len - len(p) >= MIN_NEW_TOKENS]


def calibrate_prompt_rows(
    bundle_dir: Path,
    prompts: list[str] | None = None,
    new_tokens: int = NEW_TOKENS,
    threads: int = 0,
    progress: bool = True,
) -> PromptRowsChoice:
    """Time the decode engine's passes up to growing lookup's widest (its drafts + 1), decode each
    kind's prompts on two rows with both decoders, and choose each kind's decoder."""
    texts = prompts if prompts is not None else read_prompts(str(POLICY_PROMPTS))
    generator = Generator(load_bundle(bundle_dir, verify="size"), decode_rows=2, threads=threads)
    costs = time_decode_passes(generator, GROWING_MOST)
    counts = []
    with tqdm(total=len(PROMPT_KINDS), desc="measure prompt rows", unit="kind", disable=not progress) as bar:
        for kind in PROMPT_KINDS:
            ids = fitting_ids(generator, [t for t in texts if prompt_kind(t) == kind])
            if ids:
                counts.append(kind_counts(generator, kind, ids, new_tokens))
            bar.update()
    choices = [choose(k, costs.of_rows) for k in counts]
    return PromptRowsChoice(choices, counts, costs, this_machine(threads))
