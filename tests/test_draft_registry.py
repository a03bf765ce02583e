"""The draft-source registry (runtimes/draft_registry.py): every registered name has all
its parts, one module per layer that needs it (runtime source, calibration measure, and a
graph piece when it runs engines of its own), every such module is registered, each source's
declared seams work end to end (its build option on the command line, its graph fields and
engine roles through the plan, the exporter's role assignment and the manifest's validators,
its trained table's file), and names that no longer mean a source are refused with a pointer
to the new name, on the command line and in a bundle's manifest."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptive_export.calibration.draft_builds import BuildStep
from adaptive_export.calibration.draft_sources import DraftMeasure
from adaptive_export.calibration.drafts import BUILD_STEPS, MEASURES, measure_of
from adaptive_export.commands.cli import build_parser
from adaptive_export.commands.options import BuildOptions
from adaptive_export.exporter.build import draft_engines
from adaptive_export.exporter.graph_entry import manifest_graph
from adaptive_export.graphs.drafts import GRAPH_PIECES, appended_ids, engine_roles
from adaptive_export.graphs.drafts.early_exit import ExitPlan
from adaptive_export.graphs.plan import BuildPlan
from adaptive_export.graphs.span_graph import GraphSpec
from adaptive_export.runtimes.draft_contracts import CONTRACTS
from adaptive_export.runtimes.draft_registry import DRAFT_SOURCES
from adaptive_export.runtimes.drafting import SOURCE_NAMES, SOURCES, DraftSource
from adaptive_export.runtimes.drafting.base import RUNTIME_SOURCES
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.manifest import ConfigEntry, GraphEntry
from tests.test_bad_bundles import corrupt_copy, edit_manifest, expect_usage_error

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_SHARED = frozenset({"__init__", "base", "chain"})  # runtimes/drafting/ modules that are no source


def modules_in(directory: Path) -> set[str]:
    return {path.stem for path in directory.glob("*.py")} - {"__init__"}


def stray_modules(directory: Path, shared: frozenset[str] = frozenset()) -> set[str]:
    """Modules of a per-source folder that no registered name claims."""
    return modules_in(directory) - shared - set(DRAFT_SOURCES)


def test_the_layers_read_the_one_registration_in_its_order() -> None:
    assert SOURCE_NAMES == DRAFT_SOURCES
    assert tuple(MEASURES) == DRAFT_SOURCES
    assert tuple(CONTRACTS) == DRAFT_SOURCES


@pytest.mark.parametrize("name", DRAFT_SOURCES)
def test_the_manifest_checks_the_contract_the_source_runs_with(name: str) -> None:
    """The manifest reads a source's contract (runtimes/draft_contracts.py), never the source: a
    runtime class must declare nothing of the manifest that its contract does not."""
    source, contract = SOURCES[name], CONTRACTS[name]
    assert contract.name == name
    assert source.engine_kinds == contract.engine_kinds
    assert source.graph_fields == contract.graph_fields
    assert source.table == contract.table
    assert source.check_graph_field.__func__ is contract.check_graph_field.__func__  # type: ignore[attr-defined]
    assert source.check_engines.__func__ is contract.check_engines.__func__  # type: ignore[attr-defined]


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
        assert callable(GRAPH_PIECES[name].add_graphs)


@pytest.mark.parametrize("name", BUILD_STEPS)
def test_a_build_option_reaches_the_build_under_its_source(name: str) -> None:
    """`build <model> -o <out> --<flag> <value>` parses into BuildOptions.draft_options, by source name;
    the option's default asks for nothing on a model with nothing shipped for it."""
    step = BUILD_STEPS[name]
    assert issubclass(step, BuildStep) and step.option.flag.startswith("--")
    assert step.option.dest not in {f for f in BuildOptions.__dataclass_fields__}, "it would shadow a build option"
    args = build_parser().parse_args(["build", "m", "-o", "out", step.option.flag, "3"])
    assert getattr(args, step.option.dest) == "3" and step.asked("3")
    default = build_parser().parse_args(["build", "m", "-o", "out"]).__dict__[step.option.dest]
    # not asked by default, once resolved for a model that ships nothing (a packaged model may ship a head)
    assert not step.asked(step.resolve(default, BuildOptions(model="m", output="out")))


def test_build_options_are_unique_across_sources() -> None:
    flags = [step.option.flag for step in BUILD_STEPS.values()]
    assert len(set(flags)) == len(flags), flags


# a plan of its own for each source whose graph piece reads one from BuildPlan.drafts
PIECE_PLANS: dict[str, object] = {"early_exit": ExitPlan(exit_layer=1, draft_len=2), "precision": "int8"}


def planned(name: str) -> list[GraphSpec]:
    """The graphs of a plan with the source's own plan, its draft fields each set to 1."""
    drafts = {name: PIECE_PLANS[name]} if name in PIECE_PLANS else {}
    return BuildPlan(num_layers=2, drafts=drafts, draft_fields={key: 1 for key in SOURCES[name].graph_fields}).graphs()


def planned_with_fields(name: str) -> list[GraphEntry]:
    """The same graphs as manifest entries."""
    return [manifest_graph(graph) for graph in planned(name)]


@pytest.mark.parametrize("name", [n for n in DRAFT_SOURCES if SOURCES[n].graph_fields])
def test_graph_fields_pass_the_plan_the_manifest_and_its_validator(name: str) -> None:
    """Each declared graph field is set by the source's graph piece, round-trips through the
    manifest's JSON and its validator, and the validator refuses a negative value."""
    entries = planned_with_fields(name)
    for key in SOURCES[name].graph_fields:
        carrying = [entry for entry in entries if entry.draft_field(key)]
        assert carrying, f"the graph piece of {name} sets no graph's {key}"
        for entry in entries:
            again = GraphEntry.from_json(entry.name, entry.to_json(), 2)
            assert again == entry and entry.to_json()[key] == entry.draft_field(key)
        bad = {**carrying[0].to_json(), key: -1}
        with pytest.raises(UsageError, match=f"bad {key}"):
            GraphEntry.from_json(carrying[0].name, bad, 2)


def test_every_source_with_engines_is_planned_here() -> None:
    """Each source with engines of its own plans them from PIECE_PLANS or its graph fields."""
    for name in GRAPH_PIECES:
        assert name in PIECE_PLANS or SOURCES[name].graph_fields, name


@pytest.mark.parametrize("name", [n for n in DRAFT_SOURCES if SOURCES[n].engine_kinds])
def test_engine_roles_are_assigned_by_the_exporter_and_checked_by_the_manifest(name: str) -> None:
    """The roles a source declares are among its engines, the exporter gives each to a graph of the
    declared kind (the graph piece's `engine_role`), and the source's validator accepts the result."""
    source, graphs = SOURCES[name], {graph.name: graph for graph in planned(name)}
    engines = {"decode": "decode_full", **draft_engines(list(graphs.values()), "full")}
    by_name = {name: manifest_graph(graph) for name, graph in graphs.items()}
    for role, kind in source.engine_kinds.items():
        assert role in source.engines and role in engines, (role, engines)
        assert graphs[engines[role]].kind == kind and role in engine_roles(graphs[engines[role]])
    config = ConfigEntry.from_json({"id": "full", "kept": [0, 1], "engines": engines}, by_name, 2)
    assert dict(config.engines) == engines


@pytest.mark.parametrize("name", [n for n in DRAFT_SOURCES if SOURCES[n].table is not None])
def test_a_shipped_table_has_a_build_step_and_a_graph_that_embeds_it(name: str) -> None:
    """Something must make the table (a build step) and a graph must use it (the graph piece's
    `appended_ids` / `embedding_rows`, or its `guess_head`); the file is a plain bundle file name."""
    table, piece = SOURCES[name].table, GRAPH_PIECES[name]
    assert table is not None and name in BUILD_STEPS
    embeds = piece.appended_ids is not None and piece.embedding_rows is not None
    assert embeds or piece.guess_head is not None
    assert table.file.endswith(".safetensors") and "/" not in table.file
    graphs = BuildPlan(num_layers=2, draft_fields={k: 1 for k in SOURCES[name].graph_fields}).graphs()
    assert any(appended_ids(graph) or manifest_graph(graph).guesses for graph in graphs)


def test_no_per_source_module_is_left_unregistered() -> None:
    runtime_only = frozenset(RUNTIME_SOURCES) - {"growing_lookup", "sure_lookup", "floor_guess"}  # prompt_lookup's
    assert stray_modules(ROOT / "runtimes" / "drafting", RUNTIME_SHARED | runtime_only) == set()
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
