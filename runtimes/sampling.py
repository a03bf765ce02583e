"""Greedy and temperature / top-k / top-p sampling on numpy logits, seeded.

`SamplingParams` is what the caller asks for; `make_sampler` turns it into the `Sampler` one
generation draws with (mlx-lm's `make_sampler`): the parameters and the seeded generator
together, built once per generation and passed down instead of (params, rng) pairs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from adaptive_export.runtimes.errors import UsageError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise UsageError(f"{name} {value!r} is not a number", f"pass a number for {name}")
        if (
            not isinstance(self.top_k, int)
            or isinstance(self.top_k, bool)
            or (
                self.seed is not None
                and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0)
            )
        ):
            raise UsageError("top_k must be an integer and seed a non-negative integer or None", "pass integers")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise UsageError(
                f"temperature {self.temperature} is invalid", "use 0 (greedy) or a positive number such as 0.7"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise UsageError(f"top-p {self.top_p} is outside (0, 1]", "use a value such as 0.9, or 1 to disable it")
        if self.top_k < 0:
            raise UsageError(f"top-k {self.top_k} is negative", "use 0 to disable it, or a positive count")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution that sampling draws from (after temperature, top-k and top-p), float64."""
    check_finite(logits)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = logits.astype(np.float64) / params.temperature
    if not np.isfinite(scaled).all():  # a temperature so small that it overflows: the limit is greedy
        probs = np.zeros(logits.size, dtype=np.float64)
        probs[int(np.argmax(logits))] = 1.0
        return probs
    if params.top_k and params.top_k < scaled.size:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled -= scaled.max()
    probs = np.exp(scaled)
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        cut = int(np.searchsorted(cumulative, params.top_p)) + 1  # smallest set reaching top_p
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[:cut]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def check_finite(logits: np.ndarray) -> None:
    if not np.isfinite(logits).all():
        raise UsageError(
            "the engine produced non-finite logits (NaN or infinity)",
            "the bundle is broken: rebuild it, and run `adaptive-export check` on it",
        )


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from a logits row [V]."""
    check_finite(logits)
    if params.greedy:
        return int(np.argmax(logits))
    probs = probabilities(logits, params)
    return int(rng.choice(probs.size, p=probs))


@dataclass
class Sampler:
    """Draws one generation's tokens: its parameters and its random stream (seeded once)."""

    params: SamplingParams
    rng: np.random.Generator = field(repr=False)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def choose(self, logits: np.ndarray) -> int:
        """One token from a logits row [V]."""
        return choose(logits, self.params, self.rng)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution `choose` draws from."""
        return probabilities(logits, self.params)


def make_sampler(params: SamplingParams) -> Sampler:
    """The sampler of one generation: a fresh generator seeded with `params.seed`."""
    return Sampler(params, np.random.default_rng(params.seed))
