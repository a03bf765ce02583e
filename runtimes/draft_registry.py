"""The names of the draft sources, and where each layer finds a source's module
(docs/architecture.md sections 7 and 9).

A draft source is a technique with one module per layer that needs it, all under its name:
`runtimes/drafting/<name>.py` (its `DraftSource` subclass, bound to `SOURCE`),
`calibration/drafts/<name>.py` (its `DraftMeasure` subclass, bound to `MEASURE`) and, when it
runs engines of its own, `graphs/drafts/<name>.py` (its graph piece, `add_graphs`), joined by
one registration: its contract in runtimes/draft_contracts.py `REGISTERED` (what it adds to the
manifest, nothing for prompt lookup), whose names are `DRAFT_SOURCES`. Each layer finds a name's
module by this convention, so adding a source is its modules plus that registration;
tests/test_draft_registry.py checks that every name has all its parts and that no module is
left unregistered. Torch-free, and it imports no draft source: the manifest types, the runtime,
calibration and the CLI all read it without importing the code that drafts.
"""

from __future__ import annotations

from adaptive_export.runtimes.draft_contracts import CONTRACTS

# the registered sources, in the registration's order (calibration's order, `run --draft`'s choices)
DRAFT_SOURCES = tuple(CONTRACTS)

# Names a source no longer answers to: `run --draft` and the manifest point to the new name.
# "ppd" named the prompt-token source; a later source (Predictive Pipelined Decoding) takes it.
RENAMED_SOURCES = {"ppd": "prompt_tokens"}


def runtime_module(name: str) -> str:
    return f"adaptive_export.runtimes.drafting.{name}"


def calibration_module(name: str) -> str:
    return f"adaptive_export.calibration.drafts.{name}"
