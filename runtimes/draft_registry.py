"""The one registration of draft sources (docs/architecture.md sections 7 and 9).

A draft source is a technique with one module per layer that needs it, all under its name:
`runtimes/drafting/<name>.py` (its `DraftSource` subclass, bound to `SOURCE`),
`calibration/drafts/<name>.py` (its `DraftMeasure` subclass, bound to `MEASURE`) and, when it
runs engines of its own, `graphs/drafts/<name>.py` (its graph piece, `add_graphs`). Each layer
finds a name's module by this convention, so adding a source is its modules plus its name
here (what a source adds to the manifest is its contract, runtimes/draft_contracts.py);
tests/test_draft_registry.py checks that every name has all its parts and that no module is
left unregistered. Torch-free and a leaf (it imports nothing): the manifest types, the runtime,
calibration and the CLI all read it without importing a draft source.
"""

from __future__ import annotations

# Order matters: it is the order calibration measures and reports the sources in, and the
# order of `run --draft`'s choices.
DRAFT_SOURCES = ("early_exit", "prompt_lookup", "precision", "prompt_tokens")

# Names a source no longer answers to: `run --draft` and the manifest point to the new name.
# "ppd" named the prompt-token source; a later source (Predictive Pipelined Decoding) takes it.
RENAMED_SOURCES = {"ppd": "prompt_tokens"}


def runtime_module(name: str) -> str:
    return f"adaptive_export.runtimes.drafting.{name}"


def calibration_module(name: str) -> str:
    return f"adaptive_export.calibration.drafts.{name}"
