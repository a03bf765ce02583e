"""Third-party warnings kept out of the commands' normal output.

transformers and torch warn about their own deprecations (FutureWarning, DeprecationWarning,
UserWarning) on every call a `check` or `build` makes; a CI log full of them hides the lines
that matter. The filters here are narrow: by category and by the warning's module, or only
around calls that run library code alone. Our own output is logging, which they never touch.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

NOISY_CATEGORIES: tuple[type[Warning], ...] = (
    FutureWarning,
    DeprecationWarning,
    PendingDeprecationWarning,
    UserWarning,
)
# the libraries the exporter and `check` call; a warning attributed to one of them is theirs to fix
THIRD_PARTY_MODULES = (
    r"(torch|transformers|accelerate|onnx|onnxscript|onnxruntime|gguf|coremltools|safetensors|huggingface_hub"
    r"|tokenizers|tqdm)(\.|$)"
)


@contextlib.contextmanager
def third_party_warnings_hidden() -> Iterator[None]:
    """Hide the noisy categories where the warning is attributed to a third-party module; a
    command wraps its whole run in it (also usable as a decorator)."""
    with warnings.catch_warnings():
        for category in NOISY_CATEGORIES:
            warnings.filterwarnings("ignore", category=category, module=THIRD_PARTY_MODULES)
        yield


@contextlib.contextmanager
def library_call_warnings_hidden() -> Iterator[None]:
    """Hide the noisy categories whatever module they are attributed to: only around a block
    that runs library code alone (an HF forward pass, `from_pretrained`), where a library's
    `stacklevel` may attribute its own deprecation warning to our calling line."""
    with warnings.catch_warnings():
        for category in NOISY_CATEGORIES:
            warnings.filterwarnings("ignore", category=category)
        yield
