"""How MODEL is spelled on the command line (commands/cli.py, loading/model.py): a name starting
with `-` is read as an option, and a name longer than the filesystem allows cannot even be looked
up; each is one line that says so and how to write it, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptive_export.commands.cli import main


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and ". Fix: " in lines[0], lines
    assert "unexpected" not in lines[0], lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("command", ["build", "inspect"])
def test_a_name_starting_with_a_dash_says_how_to_write_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    argv = [command, "-name", "-o", str(tmp_path / "out")] if command == "build" else [command, "-name"]
    line = one_line(capsys, argv, "'-name'", "./-name", "--")
    assert "option" in line


@pytest.mark.parametrize("length", [300, 5000])
def test_a_model_name_too_long_for_the_filesystem_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, length: int
) -> None:
    line = one_line(capsys, ["build", "a" * length, "-o", str(tmp_path / "out")], "too long")
    assert "a" * 100 not in line  # the name is shown cut, not whole
    one_line(capsys, ["build", f"org/{'b' * length}", "-o", str(tmp_path / "out")], "too long")
