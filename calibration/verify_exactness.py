"""Whether a verify pass of the decode engine reproduces plain decoding, measured at build time.

Speculative decoding verifies k drafts in one T=k+1 pass; its greedy tokens equal plain
decoding's only if that pass computes what k+1 T=1 passes compute. Float reordering between the
kernels ONNX Runtime picks for one row and for several keeps them within about 1e-6 of the logit
scale, but MatMulNBits at accuracy level 4 quantizes each activation row to int8, and a reordered
last bit that tips one rounding the other way moves the logits by 1e-3 of their scale and more
(docs/speculation.md, "Why accuracy-4 verification differs"). Whether that happens depends on the
engine's kernels and the CPU, so `build --speculate auto` measures it here on the built bundle,
and `run --mode auto` drafts only where the verify pass is exact (`runtimes/generate.py`).

ONNX Runtime's kernels for several rows compute each row alike, whatever the row count (SmolLM2's
default bundle: T=2..8 passes bit-identical to a T=9 pass, row for row); only the one-row kernels
differ. So the same comparison with plain passes of two rows, the token and a guess
(`plain_rows=2`), says whether a bundle whose plain steps carry one guess row decodes exactly
as its verify passes do (`min_decode_rows`, runtimes/speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adaptive_export.calibration.verify_cost import MAX_VERIFY_DRAFTS
from adaptive_export.runtimes.bundle import load_bundle
from adaptive_export.runtimes.generate import Generator
from adaptive_export.runtimes.manifest_speculation import VerifyExactness

PROMPTS = 8  # verify windows compared, each after its own prefill
PREFIX_TOKENS = 48
SEED = 0  # fixed token ids: the same measurement on every build


@dataclass(frozen=True)
class Window:
    """One prompt's comparison: the verify pass's logits and the plain steps' logits, [T, V]."""

    verify: np.ndarray
    plain: np.ndarray

    def flip_margins(self) -> list[float]:
        """Plain decoding's top-1 margin over the verify pass's argmax, at each row where they differ."""
        picked, plain_top = self.verify.argmax(-1), self.plain.argmax(-1)
        rows = np.flatnonzero(picked != plain_top)
        return [float(self.plain[r, plain_top[r]] - self.plain[r, picked[r]]) for r in rows]


def _window(generator: Generator, prefix: np.ndarray, tokens: np.ndarray, guesses: np.ndarray) -> Window:
    """Prefill `prefix`, then score `tokens` in one pass and again one token per pass; a plain pass
    also carries the token's guesses (row 0 is compared, the guess rows are overwritten next pass)."""
    backend, arena = generator.backend, generator.arena
    engine = generator.bundle.config("full").decode
    start = prefix.shape[1]
    backend.run("prefill", prefix, arena, 0)
    verify = backend.run(engine, tokens, arena, start).logits[0].copy()
    backend.run("prefill", prefix, arena, 0)
    plain = []
    for i in range(tokens.shape[1]):
        inputs = np.concatenate([tokens[:, i : i + 1], guesses[:, i : i + 1, :].reshape(1, -1)], axis=1)
        plain.append(backend.run(engine, inputs, arena, start + i).logits[0, 0].copy())
    return Window(verify, np.stack(plain))


def measure_verify_exactness(
    bundle_dir: Path, max_k: int = MAX_VERIFY_DRAFTS, prompts: int = PROMPTS, threads: int = 0, plain_rows: int = 1
) -> VerifyExactness:
    """Compare one T = max_k + 1 pass with max_k + 1 plain passes of `plain_rows` rows (the token, then
    plain_rows - 1 fixed guesses) over the same fixed tokens, on the full configuration's decode engine
    as `run` runs it, after each of `prompts` prefixes."""
    generator = Generator(load_bundle(bundle_dir, verify="size"), threads=threads)
    vocab, max_len = generator.bundle.model.vocab_size, generator.bundle.max_len
    width = max(1, min(max_k + 1, max_len - 1))
    prefix_len = max(1, min(PREFIX_TOKENS, max_len - width - plain_rows))
    rng = np.random.default_rng(SEED)
    windows = [
        _window(
            generator,
            rng.integers(0, vocab, (1, prefix_len)),
            rng.integers(0, vocab, (1, width)),
            rng.integers(0, vocab, (1, width, plain_rows - 1)),
        )
        for _ in range(prompts)
    ]
    diff = max(float(np.abs(w.verify - w.plain).max()) for w in windows)
    scale = max(float(np.abs(w.plain).max()) for w in windows)
    margins = [m for w in windows for m in w.flip_margins()]
    worst = round(max(margins, default=0.0), 6)
    return VerifyExactness(round(diff, 7), round(scale, 4), len(margins), worst, plain_rows)
