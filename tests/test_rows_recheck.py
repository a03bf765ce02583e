"""The default run is never slower than `--mode ar` where the bundle runs (runtimes/rows_choice.py,
runtimes/rows_recheck.py): `build` counts each prompt kind's passes under both two-row decoders and
prices them with its own pass costs; a bundle run on another machine times its passes there,
chooses again, and keeps the timings in the user's cache. A decode engine made to cost far more
at two rows than at one (a side branch whose work grows with the rows) decodes plainly, both when
`build` measures it and when `run` re-measures it, and the tokens stay `--mode ar`'s."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from adaptive_export.commands.cli import main
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.machine import this_machine
from adaptive_export.runtimes.manifest_prompt_rows import PromptRows
from adaptive_export.runtimes.pass_costs import VerifyCosts
from adaptive_export.runtimes.rows_choice import KindCounts, choose
from adaptive_export.runtimes.rows_recheck import rechosen
from tests.conftest import needs_smollm2
from tests.test_decode_policy import CHAT, EDIT
from tests.test_hardening import resign

SLOW_SIDE, SLOW_CHAIN = 1024, 64  # the side branch: each extra row through 64 products of [1024, 1024]


def costs(*ratios: float) -> VerifyCosts:
    """Pass costs of T = 1, 2, ... as these ratios of a 10 ms one-row pass."""
    return VerifyCosts("decode_full", 64, 3, {t: 10.0 * r for t, r in enumerate((1.0, *ratios), start=1)})


COUNTS = KindCounts("edit", 4, 200, growing={2: 60, 3: 20, 4: 20}, floor={2: 130}, floor_tokens=200)


def test_the_cheapest_decoder_within_the_margin_is_chosen() -> None:
    """Growing: 60c2 + 20c3 + 20c4 over 200 tokens; floor: 130c2 over 200; plain: 1.0."""
    cheap_wide = choose(COUNTS, costs(1.1, 1.2, 1.3).of_rows)
    assert (cheap_wide.decoder, cheap_wide.growing_cost, cheap_wide.floor_cost) == ("growing", 0.58, 0.715)
    dear_wide = choose(COUNTS, costs(1.1, 2.4, 3.6).of_rows)  # growing 0.93 against floor 0.715
    assert (dear_wide.decoder, dear_wide.rows) == ("floor", 2)
    dear_two = choose(COUNTS, costs(1.6, 2.4, 3.6).of_rows)  # floor 1.04, growing 1.08: neither saves 5%
    assert (dear_two.decoder, dear_two.rows) == ("plain", 1)
    older = choose(KindCounts("chat", 4, 200, {2: 150}, {}), costs(1.2).of_rows)  # no floor counts
    assert (older.decoder, older.growing_cost) == ("growing", 0.9)
    assert costs(1.1, 1.3).of_rows(5) == pytest.approx(1.7)  # wider than timed: the last step extended


def counted_section(machine: dict[str, Any]) -> dict[str, Any]:
    passes = {"growing": {"2": 60, "3": 20, "4": 20}, "floor": {"2": 130}}
    measured = {
        "passes": {"edit": passes, "chat": passes},
        "tokens": {"edit": 200, "chat": 200},
        "floor_tokens": {"edit": 200, "chat": 200},
        "prompts": {"edit": 4, "chat": 4},
        "machine": machine,
    }
    return {"edit": 2, "chat": 2, "decoders": {"edit": "growing", "chat": "growing"}, "measured": measured}


ELSEWHERE = {"cpu": "Some Other CPU", "flags": "avx512f", "cpus": 64, "threads": 8}


def test_the_choice_is_made_again_from_the_counts_with_other_pass_costs() -> None:
    section = PromptRows.from_json(counted_section(ELSEWHERE))
    assert section is not None and section.machine is not None and section.machine.cpu == "Some Other CPU"
    here = rechosen(section, costs(1.6, 2.4, 3.6))
    assert dict(here.rows) == {"edit": 1, "chat": 1} and here.decoder_of("edit") == "plain"
    assert rechosen(section, costs(1.1, 2.4, 3.6)).decoder_of("chat") == "floor"
    assert json.loads(json.dumps(here.to_json()))["measured"]["machine"] == ELSEWHERE  # kept for tools


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda s: s["measured"]["passes"]["edit"]["growing"].update({"99": 1}), "names rows '99'"),
        (lambda s: s["measured"]["passes"]["edit"]["floor"].update({"2": -1}), "floor.2 must be a count"),
        (lambda s: s["measured"]["passes"].update({"poem": {}}), "passes names 'poem'"),
        (lambda s: s["measured"]["tokens"].update({"chat": "many"}), "tokens.chat must be a count"),
        (lambda s: s["measured"].update({"floor_tokens": [1]}), "floor_tokens must be an object"),
        (lambda s: s["measured"]["machine"].update({"cpu": "x" * 5000}), "machine.cpu must be a short string"),
        (lambda s: s["measured"]["machine"].update({"threads": 0}), "machine.threads must be a thread count"),
        (lambda s: s.update({"edit": 1}), "decoders names 'edit', no two-row kind"),
        (lambda s: s["decoders"].update({"chat": "eagle"}), "decoders.chat must be one of growing, floor"),
    ],
)
def test_a_hostile_measurement_is_refused_in_one_line(change: Any, problem: str) -> None:
    section = counted_section(dict(ELSEWHERE))
    change(section)
    with pytest.raises(UsageError, match=problem.replace("(", r"\(")):
        PromptRows.from_json(section)


# ---- on built engines ----------------------------------------------------------------------
def slow_two_rows(engine: Path, chain: int = SLOW_CHAIN) -> None:
    """Add to a decode engine a side branch that multiplies min(T - 1, 15) rows through a chain of
    SLOW_CHAIN [SLOW_SIDE, SLOW_SIDE] products, folded into the logits times zero: the answers are
    unchanged, a one-row pass does no extra work, and a two-row pass costs many one-row passes."""
    model = onnx.load(str(engine), load_external_data=False)
    graph = model.graph
    ids, logits = graph.input[0].name, graph.output[0].name
    side = np.random.default_rng(0).standard_normal((SLOW_SIDE, SLOW_SIDE)).astype(np.float32) / SLOW_SIDE
    constants = {
        "slow_side": side,
        "slow_row": side[:1],
        "slow_one": np.array([1], dtype=np.int64),
        "slow_most": np.array([15], dtype=np.int64),
        "slow_width": np.array([SLOW_SIDE], dtype=np.int64),
        "slow_zero": np.array(0.0, dtype=np.float32),
    }
    graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in constants.items())
    fast_logits = "slow_fast_logits"
    for node in graph.node:  # the node that made the logits now makes them under another name
        node.output[:] = [fast_logits if name == logits else name for name in node.output]
    nodes = [
        helper.make_node("Shape", [ids], ["slow_rows"], start=1, end=2),
        helper.make_node("Sub", ["slow_rows", "slow_one"], ["slow_extra_rows"]),
        helper.make_node("Min", ["slow_extra_rows", "slow_most"], ["slow_count"]),
        helper.make_node("Concat", ["slow_count", "slow_width"], ["slow_shape"], axis=0),
        helper.make_node("Expand", ["slow_row", "slow_shape"], ["slow_0"]),
    ]
    nodes += [helper.make_node("MatMul", [f"slow_{n}", "slow_side"], [f"slow_{n + 1}"]) for n in range(chain)]
    nodes += [
        helper.make_node("ReduceSum", [f"slow_{chain}"], ["slow_sum"], keepdims=0),
        helper.make_node("Mul", ["slow_sum", "slow_zero"], ["slow_nothing"]),
        helper.make_node("Add", [fast_logits, "slow_nothing"], [logits]),
    ]
    graph.node.extend(nodes)
    onnx.save(model, str(engine))


def decode_engine(bundle: Path) -> Path:
    manifest = json.loads((bundle / "manifest.json").read_text())
    decode = next(c for c in manifest["configs"] if c["id"] == "full")["engines"]["decode"]
    return bundle / manifest["backends"]["onnx"]["graphs"][decode]["file"]


def moved_elsewhere(bundle: Path, target: Path, slow: bool, chain: int = SLOW_CHAIN) -> Path:
    """A copy of the bundle whose manifest says it was measured on another machine (re-signed)."""
    shutil.copytree(bundle, target)
    if slow:
        slow_two_rows(decode_engine(target), chain)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["prompt_rows"]["measured"]["machine"] = dict(ELSEWHERE)
    resign(target, manifest)
    return target


def run_json(capsys: pytest.CaptureFixture[str], bundle: Path, prompt: str, *flags: str) -> dict[str, Any]:
    assert main(["run", str(bundle), "-p", prompt, "--raw", "--max-new-tokens", "8", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def measured_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("measured") / "tiny"
    assert main(["build", str(tiny_model_dir), "-o", str(out), "--max-len", "512"]) == 0
    return out


@pytest.fixture
def user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ADAPTIVE_EXPORT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_build_records_its_counts_and_machine_and_inspect_shows_the_choice(
    capsys: pytest.CaptureFixture[str], measured_bundle: Path, user_cache: Path
) -> None:
    section = json.loads((measured_bundle / "manifest.json").read_text())["prompt_rows"]
    assert section["measured"]["machine"] == this_machine(0).to_json()
    assert set(section["measured"]["passes"]) == {"edit", "chat"}
    assert main(["inspect", str(measured_bundle)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("decode rows per prompt kind"))
    assert "steps/token" in line and f"measured on {this_machine(0).cpu}" in line
    stats = run_json(capsys, measured_bundle, EDIT)["stats"]
    assert stats["policy_measured_on"] == "build" and not any(user_cache.glob("pass-costs/*.json"))


def test_on_another_machine_the_passes_are_timed_once_and_the_tokens_stay_ars(
    capsys: pytest.CaptureFixture[str], measured_bundle: Path, tmp_path: Path, user_cache: Path
) -> None:
    moved = moved_elsewhere(measured_bundle, tmp_path / "moved", slow=False)
    first = run_json(capsys, moved, EDIT)
    assert (first["stats"]["policy_measured_on"], first["stats"]["decode_rows"]) == ("this machine", 2)
    assert len(list(user_cache.glob("pass-costs/*.json"))) == 1
    again, ar = run_json(capsys, moved, EDIT), run_json(capsys, moved, EDIT, "--mode", "ar")
    assert again["stats"]["policy_measured_on"] == "this machine, cached"
    assert again["tokens"] == ar["tokens"] and ar["stats"]["decode_rows"] == again["stats"]["decode_rows"]
    (next(user_cache.glob("pass-costs/*.json"))).write_text('{"pass_ms": {"1": -1}}')  # damaged: timed afresh
    assert run_json(capsys, moved, EDIT)["stats"]["policy_measured_on"] == "this machine"


def test_a_source_that_costs_more_than_it_saves_decodes_plainly_where_it_is_run(
    capsys: pytest.CaptureFixture[str], measured_bundle: Path, tmp_path: Path, user_cache: Path
) -> None:
    slow = moved_elsewhere(measured_bundle, tmp_path / "slow", slow=True)
    for prompt in (EDIT, CHAT):
        default, ar = run_json(capsys, slow, prompt), run_json(capsys, slow, prompt, "--mode", "ar")
        stats = default["stats"]
        assert (stats["policy"], stats["decode_rows"]) == ("plain", 1), stats
        assert stats["policy_measured_on"].startswith("this machine")
        assert default["tokens"] == ar["tokens"] and ar["stats"]["decode_rows"] == 1
    one_row = ("--decode-rows", "1")  # the side branch changed no answer
    assert (
        run_json(capsys, slow, EDIT, *one_row)["tokens"] == run_json(capsys, measured_bundle, EDIT, *one_row)["tokens"]
    )


def test_the_build_measures_such_a_source_and_keeps_plain_steps(measured_bundle: Path, tmp_path: Path) -> None:
    from adaptive_export.calibration.prompt_rows import calibrate_prompt_rows

    slow = moved_elsewhere(measured_bundle, tmp_path / "slow", slow=True)
    choice = calibrate_prompt_rows(slow, progress=False)
    assert choice.rows == {"edit": 1, "chat": 1}, [(c.kind, c.growing_cost, c.floor_cost) for c in choice.choices]
    assert choice.costs.cost(1) > 2  # the side branch is what a two-row pass pays


@needs_smollm2
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_on_smollm2_a_slowed_two_row_pass_decodes_plainly_with_ars_tokens(
    capsys: pytest.CaptureFixture[str], smol_default_bundle: Path, tmp_path: Path, user_cache: Path
) -> None:
    """The packaged model's default bundle, its decode engine slowed at two rows and more, run as
    if built elsewhere: its first run times the passes, and every kind then decodes plainly."""
    slow = moved_elsewhere(smol_default_bundle, tmp_path / "slow", slow=True, chain=4 * SLOW_CHAIN)
    for prompt in (EDIT, CHAT):
        default, ar = run_json(capsys, slow, prompt), run_json(capsys, slow, prompt, "--mode", "ar")
        stats = default["stats"]
        assert (stats["policy"], stats["decode_rows"]) == ("plain", 1), stats
        assert stats["policy_measured_on"].startswith("this machine")
        assert default["tokens"] == ar["tokens"]
    section = json.loads((smol_default_bundle / "manifest.json").read_text())["prompt_rows"]
    assert 2 in (section["edit"], section["chat"])  # as built, two rows paid for some kind
