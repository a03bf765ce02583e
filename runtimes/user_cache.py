"""The one per-user cache folder: assembled packaged models, TensorRT engines, pass timings."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """$ADAPTIVE_EXPORT_CACHE, else $XDG_CACHE_HOME/adaptive-export, else ~/.cache/adaptive-export."""
    if os.environ.get("ADAPTIVE_EXPORT_CACHE"):
        return Path(os.environ["ADAPTIVE_EXPORT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "adaptive-export"
