"""How a request decodes, as one frozen record: `Generator`, `run`, `bench` and `serve` all take a
`DecodingSettings`, so each default is written here once and each value is checked here once
(issue #39: the mode's default used to be "ar" in the library and `serve`'s worker, "auto" in `run`)."""

from __future__ import annotations

from dataclasses import dataclass

from adaptive_export.runtimes.decoders import Mode
from adaptive_export.runtimes.drafting import chain_names
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.limits import check_draft_len


@dataclass(frozen=True)
class DecodingSettings:
    """Which layers run and how tokens after the first are decoded. Checked when made: an unknown
    mode or draft source, or a draft length outside the limits, is refused with one line."""

    config: str = "auto"  # "auto": the routers pick at prefill; else a configuration id from `inspect`
    mode: str = "auto"  # a runtimes/decoders.py Mode: auto chooses at prefill and keeps ar's tokens
    draft: str | None = None  # spec's draft source, or sources joined by commas (None: calibration's)
    draft_len: int | None = None  # drafts per round (None: the source's calibrated length)

    def __post_init__(self) -> None:
        if not isinstance(self.config, str):
            raise UsageError(f"config {self.config!r} is not a configuration id", "pass 'auto' or an id from `inspect`")
        object.__setattr__(self, "mode", Mode.parse(self.mode).value)  # a Mode member is taken as its name
        if self.draft is not None:
            chain_names(self.draft if isinstance(self.draft, str) else repr(self.draft))  # one line for an unknown name
        object.__setattr__(self, "draft_len", check_draft_len(self.draft_len))

    @property
    def parsed_mode(self) -> Mode:
        return Mode(self.mode)


DEFAULT_DECODING = DecodingSettings()
