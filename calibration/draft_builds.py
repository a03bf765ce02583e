"""Draft sources made at build time by an option of their own (docs/architecture.md section 7).

A source whose drafts need something trained or loaded before export (prompt tokens' table)
declares it in its calibration module, `calibration/drafts/<name>.py`, bound to `BUILD`: a
`BuildStep` with its `build` option (flag, default, help), a fast `check` of the option's value
that runs before minutes of loading, and `build`, which returns a typed `SourceBuild`: what the
generic build loop (commands/build.py) hands the graph pieces, the exporter, the manifest and
calibration.json. The command line and the build never name the source. Torch-free at import:
the CLI builds its parser from these declarations.
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class BuildOption:
    """A `build` option of a draft source: a string value, `off` values meaning not asked."""

    flag: str
    default: str
    metavar: str
    help: str
    off: tuple[str, ...] = ("0", "none", "")

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(self.flag, default=self.default, metavar=self.metavar, help=self.help)


@dataclass(frozen=True)
class SourceBuild:
    """What a source's build step made, for each later stage of the build."""

    name: str  # the source's registered name
    chosen_by: str  # its option's flag: the manifest's `chosen_by` when no --speculate chooses
    draft_fields: dict[str, int]  # BuildPlan.draft_fields: what its graph piece sets
    table: Any  # ModelParts.draft_tables[name]: the tensor its graphs embed
    section: dict[str, Any]  # its manifest `speculation` section
    rounds: dict[str, Any]  # its calibration.json `speculation` entry (simulated rounds)
    files: dict[str, bytes] = field(default_factory=dict)  # bundle files beside the engines
    draft_vocab: Any = (
        None  # ModelParts.draft_vocab: the ascending token ids its heads score (draft_vocab.bin), or None
    )


class BuildStep(ABC):
    """A draft source made at build time, by its own option."""

    option: ClassVar[BuildOption]

    @classmethod
    def asked(cls, value: str | None) -> bool:
        return value not in cls.option.off and value is not None

    @classmethod
    def resolve(cls, value: str, options: Any) -> str:
        """The option's value once the other build options are known (a default that depends on
        the model, such as a head shipped for it); the value itself unless the step says otherwise."""
        return value

    @classmethod
    def trains(cls, value: str) -> bool:
        """Whether `build` needs the fp32 model (training); a step that only loads a file need not."""
        return True

    @classmethod
    def streams(cls, value: str) -> bool:
        """Whether the export can still stream the weights from a .gguf with this source in its
        graphs (exporter/lean_export.py): its graph piece reads no model weight as floats."""
        return False

    @staticmethod
    @abstractmethod
    def check(value: str) -> None:
        """The option's value, checked before the model loads (a UsageError when bad)."""

    @staticmethod
    @abstractmethod
    def build(value: str, loaded: Any, prompts: Sequence[str], seed: int) -> SourceBuild:
        """Train (or load) what the source drafts with, and simulate its rounds on the prompts."""
