"""The trained EAGLE heads that ship with the packaged models (samples/heads/, made by
benchmarks/eagle_heads.py): `build` of a packaged model includes its head without training."""

from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "samples" / "heads"


def shipped_head(model: str) -> Path | None:
    """The head file shipped for a packaged model name, or None (any other model, or none shipped)."""
    path = SHIPPED_DIR / f"{model}.safetensors"
    return path if "/" not in model and path.is_file() else None
