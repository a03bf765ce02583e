"""The one table from a request's mode and rows to its decoder (runtimes/decoders.py, issue #39).

What it guards: `Mode`'s members are named in that table alone (no decoder chosen by branches
elsewhere in runtimes/), every mode has a decoder at one row and at two, and the decoder a
request gets is the table's: two-row `ar` runs floor rounds, named as such, and `auto` on a
bundle whose verify pass is inexact runs plain steps.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from adaptive_export.runtimes import Generator
from adaptive_export.runtimes.decoders import (
    DECODERS,
    PLAIN_STEPS,
    FloorRounds,
    GatedSpeculative,
    Mode,
    Pipelined,
    PlainSteps,
    Speculative,
    decoder_for,
)

RUNTIMES = Path(__file__).resolve().parents[1] / "runtimes"


def mode_members_named(path: Path) -> list[str]:
    """`Mode.AR`-style references in a source file."""
    names = {mode.name for mode in Mode}
    return [
        f"{path.name}:{node.lineno} Mode.{node.attr}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "Mode"
        and node.attr in names
    ]


def test_mode_members_are_named_in_the_decoder_table_alone() -> None:
    outside = [
        ref for path in sorted(RUNTIMES.rglob("*.py")) if path.name != "decoders.py" for ref in mode_members_named(path)
    ]
    assert outside == []
    assert mode_members_named(RUNTIMES / "decoders.py")  # the table itself names them


def test_every_mode_has_a_decoder_at_one_row_and_at_two() -> None:
    assert set(DECODERS) == {(mode, wide) for mode in Mode for wide in (False, True)}
    expected = {Mode.SPEC: Speculative, Mode.AUTO: GatedSpeculative, Mode.PIPELINED: Pipelined}
    for mode, kind in expected.items():
        assert isinstance(decoder_for(mode, 1), kind) and isinstance(decoder_for(mode, 2), kind)
    assert isinstance(decoder_for(Mode.AR, 1), PlainSteps) and isinstance(decoder_for(Mode.AR, 2), FloorRounds)
    # only the decoders whose tokens stay ar's let the prompt choose the rows
    assert {mode for mode in Mode if decoder_for(mode, 1).prompt_rows} == {Mode.AR, Mode.AUTO}


def test_a_request_gets_the_tables_decoder(tiny_bundle: Path) -> None:
    """The tiny bundle is GGUF-free fp32 at one row: auto stays gated speculation (exact), ar is plain
    steps; forced to two rows, ar is floor rounds and reports them."""
    one_row = Generator(tiny_bundle)
    assert isinstance(one_row._request("hello", mode="auto").decoder, GatedSpeculative)
    assert one_row._request("hello", mode="ar").decoder is PLAIN_STEPS
    two_rows = Generator(tiny_bundle, decode_rows=2)
    request = two_rows._request("hello", mode="ar")
    assert isinstance(request.decoder, FloorRounds) and request.decode_args.rows == 2
    result = two_rows.generate("hello", max_new_tokens=8, mode="ar")
    assert result.stats.mode == "ar" and result.stats.speculation["floor_rounds"] > 0


def test_an_unknown_mode_is_one_usage_error(tiny_bundle: Path) -> None:
    from adaptive_export.runtimes.errors import UsageError

    with pytest.raises(UsageError, match="mode 'fast' is unknown"):
        Generator(tiny_bundle).generate("hello", mode="fast")
