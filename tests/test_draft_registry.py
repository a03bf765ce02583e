"""The draft-source registry (runtimes/drafting/registry.py): every registered name has all
its parts, one module per layer that needs it (runtime source, calibration measure, and a
graph piece when it runs engines of its own), every such module is registered, and names
that no longer mean a source are refused with a pointer to the new name, on the command line
and in a bundle's manifest."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptive_export.calibration.draft_sources import DraftMeasure
from adaptive_export.calibration.drafts import MEASURES, measure_of
from adaptive_export.graphs.drafts import GRAPH_PIECES
from adaptive_export.runtimes.drafting import SOURCE_NAMES, SOURCES, DraftSource
from adaptive_export.runtimes.drafting.registry import DRAFT_SOURCES
from tests.test_bad_bundles import corrupt_copy, edit_manifest, expect_usage_error

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_SHARED = frozenset({"__init__", "base", "registry"})  # runtimes/drafting/ modules that are no source


def modules_in(directory: Path) -> set[str]:
    return {path.stem for path in directory.glob("*.py")} - {"__init__"}


def stray_modules(directory: Path, shared: frozenset[str] = frozenset()) -> set[str]:
    """Modules of a per-source folder that no registered name claims."""
    return modules_in(directory) - shared - set(DRAFT_SOURCES)


def test_the_layers_read_the_one_registration_in_its_order() -> None:
    assert SOURCE_NAMES == DRAFT_SOURCES
    assert tuple(MEASURES) == DRAFT_SOURCES


@pytest.mark.parametrize("name", DRAFT_SOURCES)
def test_every_source_has_its_runtime_module_and_measure(name: str) -> None:
    source, measure = SOURCES[name], measure_of(name)
    assert (ROOT / "runtimes" / "drafting" / f"{name}.py").is_file()
    assert (ROOT / "calibration" / "drafts" / f"{name}.py").is_file()
    assert issubclass(source, DraftSource) and source.name == name
    assert issubclass(measure, DraftMeasure) and measure.name == name


@pytest.mark.parametrize("name", DRAFT_SOURCES)
def test_a_source_with_engines_has_a_graph_piece(name: str) -> None:
    """Its engines are graphs some piece must plan; a source without engines plans none."""
    assert (name in GRAPH_PIECES) == bool(SOURCES[name].engines), (name, SOURCES[name].engines)
    if name in GRAPH_PIECES:
        assert callable(GRAPH_PIECES[name])


def test_no_per_source_module_is_left_unregistered() -> None:
    assert stray_modules(ROOT / "runtimes" / "drafting", RUNTIME_SHARED) == set()
    assert stray_modules(ROOT / "calibration" / "drafts") == set()
    assert stray_modules(ROOT / "graphs" / "drafts") == set()
    assert set(GRAPH_PIECES) == modules_in(ROOT / "graphs" / "drafts")


def test_an_unregistered_module_is_noticed(tmp_path: Path) -> None:
    for name in (*DRAFT_SOURCES, "__init__", "lookahead"):
        (tmp_path / f"{name}.py").write_text("")
    assert stray_modules(tmp_path) == {"lookahead"}


def test_run_draft_ppd_names_prompt_tokens(tiny_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = expect_usage_error(["run", str(tiny_bundle), "-p", "hi", "--mode", "spec", "--draft", "ppd"], capsys)
    assert "prompt_tokens" in err, err


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(speculation={"source": "ppd", "auto_enabled": False}),
        lambda m: m.update(speculation={"source": None, "ppd": {"draft_len": 2}}),
    ],
    ids=["source", "section"],
)
def test_bundle_with_the_old_prompt_tokens_name_says_rebuild(
    edit: object, tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = corrupt_copy(tiny_bundle, tmp_path, edit_manifest(edit))  # type: ignore[arg-type]
    expect_usage_error(["run", str(copy), "-p", "hi"], capsys, "'ppd'", "'prompt_tokens'", "rebuild the bundle")
