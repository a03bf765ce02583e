"""Which decoder each kind of prompt gets: plain one-row steps, `--mode ar`'s two-row floor rounds,
or the default's growing prompt lookup on two rows, priced from counted passes.

Greedy pass counts are deterministic (`build` counts them once, on the built engines); what a
pass of T rows costs against one row is the machine's. So a choice is a pure function of the
counts and one machine's pass costs: `build` makes it with its own timings
(calibration/prompt_rows.py) and `run` makes it again with this machine's where the bundle was
built elsewhere (runtimes/rows_recheck.py). Two rows must save 5% per token over plain steps (a
one-shot run's noise band), else plain steps are kept; growing lookup is kept over floor rounds
unless it measured costlier (both are exact decoders over the same rows, priced from the same
counts and pass costs, so their difference is no noise of its own), and then the default is
`--mode ar` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

TWO_ROWS_PAY = 0.95  # two rows must save 5% per token over one-row steps
GROWING_PAYS = 1.0  # growing lookup must cost no more per token than floor rounds
DECODER_NAMES = ("plain", "floor", "growing")


@dataclass(frozen=True)
class KindCounts:
    """One kind's measured prompts, the tokens their passes emitted, and the passes by rows of
    both two-row decoders (the default's growing lookup, `--mode ar`'s floor rounds)."""

    kind: str
    prompts: int
    tokens: int
    growing: Mapping[int, int]
    floor: Mapping[int, int]
    floor_tokens: int = 0  # the floor rounds' own tokens (near-ties can end a run elsewhere)


@dataclass(frozen=True)
class KindChoice:
    """A kind's decoder and what each two-row decoder costs per token, in one-row steps."""

    kind: str
    decoder: str  # one of DECODER_NAMES
    growing_cost: float
    floor_cost: float

    @property
    def rows(self) -> int:
        return 1 if self.decoder == "plain" else 2


def cost_per_token(passes: Mapping[int, int], tokens: int, pass_cost: Callable[[int], float]) -> float:
    """Every pass at its cost in one-row steps, over the tokens the passes emitted (1.0: no tokens)."""
    if tokens <= 0:
        return 1.0
    return round(sum(count * pass_cost(rows) for rows, count in passes.items()) / tokens, 3)


def choose(counts: KindCounts, pass_cost: Callable[[int], float]) -> KindChoice:
    """The cheapest decoder within the margins; a kind without floor counts (an older build)
    compares growing lookup with plain steps only."""
    growing = cost_per_token(counts.growing, counts.tokens, pass_cost)
    floor = cost_per_token(counts.floor, counts.floor_tokens, pass_cost) if counts.floor else float("inf")
    two_rows = "growing" if growing <= GROWING_PAYS * floor else "floor"
    best = min(growing, floor)
    decoder = two_rows if best <= TWO_ROWS_PAY else "plain"
    return KindChoice(counts.kind, decoder, growing, floor if counts.floor else growing)
