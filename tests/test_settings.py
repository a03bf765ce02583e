"""One decoding record (issue #39): `run`, `bench`, `serve` and `Generator` decode with the same
`DecodingSettings`, whose defaults are written once, and whose values are checked once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from adaptive_export.commands.cli import build_parser
from adaptive_export.commands.options import BenchOptions, RunOptions, ServeOptions
from adaptive_export.runtimes.decoders import MODES
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.settings import DEFAULT_DECODING, DecodingSettings

PACKAGE = Path(__file__).parents[1]
SOURCES = ("commands", "runtimes", "exporter", "calibration", "loading", "graphs")


def decoding_defaults_outside_settings() -> list[str]:
    """Every default written for a request's mode (one of MODES) or for a request's config ("auto")
    outside runtimes/settings.py: parameters and annotated fields alike."""
    found = []
    for path in sorted(p for folder in SOURCES for p in (PACKAGE / folder).rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() == "runtimes/settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            pairs: list[tuple[str, ast.expr | None]] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                positional = node.args.posonlyargs + node.args.args
                defaults = node.args.defaults
                pairs += [(a.arg, d) for a, d in zip(positional[len(positional) - len(defaults) :], defaults)]
                pairs += [(a.arg, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                pairs.append((node.target.id, node.value))
            for name, default in pairs:
                value = default.value if isinstance(default, ast.Constant) else None
                if (name == "mode" and value in MODES) or (name == "config" and value == "auto"):
                    found.append(f"{path.relative_to(PACKAGE).as_posix()}:{node.lineno} {name}={value!r}")
    return found


def test_decoding_defaults_are_written_once() -> None:
    assert decoding_defaults_outside_settings() == []


def test_every_command_starts_from_the_one_record() -> None:
    parser = build_parser()
    run = RunOptions.from_args(parser.parse_args(["run", "b", "-p", "hi"]))
    bench = BenchOptions.from_args(parser.parse_args(["bench", "b"]))
    serve = ServeOptions.from_args(parser.parse_args(["serve", "b"]))
    assert run.decoding == bench.decoding == serve.run.decoding == DEFAULT_DECODING
    assert DEFAULT_DECODING.mode == "auto"  # adaptive decoding on by default (issue #37)


def test_the_command_line_fills_the_record() -> None:
    argv = [
        "run",
        "b",
        "-p",
        "hi",
        "--mode",
        "spec",
        "--draft",
        "prompt_lookup",
        "--draft-len",
        "3",
        "--config",
        "full",
    ]
    run = RunOptions.from_args(build_parser().parse_args(argv))
    assert run.decoding == DecodingSettings("full", "spec", "prompt_lookup", 3)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"mode": "fast"}, "mode 'fast' is unknown"),
        ({"draft": "oracle"}, "draft source 'oracle' is unknown"),
        ({"draft": ["prompt_lookup"]}, "is unknown"),
        ({"draft_len": 0}, "draft length 0 is outside"),
        ({"draft_len": True}, "draft length True is outside"),
        ({"config": 3}, "config 3 is not a configuration id"),
    ],
)
def test_bad_settings_are_refused_when_made(fields: dict[str, object], problem: str) -> None:
    with pytest.raises(UsageError, match=problem.replace("(", r"\(")):
        DecodingSettings(**fields)  # type: ignore[arg-type]


def test_generator_takes_the_record_or_its_fields(tiny_bundle: Path) -> None:
    from adaptive_export.runtimes import Generator

    generator = Generator(tiny_bundle)
    by_record = generator.generate("The sea", max_new_tokens=6, raw=True, decoding=DecodingSettings(mode="ar"))
    by_fields = generator.generate("The sea", max_new_tokens=6, raw=True, mode="ar")
    default = generator.generate("The sea", max_new_tokens=6, raw=True)
    assert by_record.tokens == by_fields.tokens and by_record.stats.mode == "ar"
    assert default.stats.mode == generator.generate("The sea", max_new_tokens=6, raw=True, mode="auto").stats.mode
    with pytest.raises(UsageError, match="passed without config/mode/draft/draft_len beside it"):
        generator.generate("The sea", max_new_tokens=6, decoding=DecodingSettings(), mode="ar")
    with pytest.raises(TypeError, match="unexpected keyword argument 'drafts'"):
        generator.generate("The sea", max_new_tokens=6, drafts="prompt_lookup")  # type: ignore[call-arg]
