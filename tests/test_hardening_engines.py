"""Engines made only of allowed ops that would exhaust the machine (issue #27 item 3): each runs in a
bounded child (tests/bounded.py: 10 s, RLIMIT_AS 1.5 GiB) and must end with one `error:` line.

- memory bombs: a ConstantOfShape or Expand of 5 GB from constant shapes (refused by the graph
  policy: shape-producing ops must take their sizes from the graph's own shapes) and a Concat that
  doubles a dynamic tensor (passes the policy; stopped by ONNX Runtime's arena ceiling);
- a chain of 200 2048x2048 MatMuls (about 60 s unbounded on 2 cores): stopped by the time bound;
- SIGINT while that chain runs: exit 130 within 2 s.

Each bundle is forged from the tiny bundle with its checksums recomputed (tests/test_hardening.py).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.bounded import Outcome, assert_one_error_line, finish, start_cli
from tests.test_hardening import edit_engine, make_bad

PROMPT = ["-p", "The sea", "--max-new-tokens", "2"]
FIVE_GB_FLOATS = 5 * (1 << 30) // 4


def _into_logits(model: onnx.ModelProto, nodes: list[onnx.NodeProto], scalar: str) -> None:
    """Route the engine's logits through `nodes`, adding 0 * `scalar` so nothing is pruned as unused."""
    for node in model.graph.node:
        for index, output in enumerate(node.output):
            if output == "logits":
                node.output[index] = "logits_raw"
    model.graph.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), "zero"))
    model.graph.node.extend(
        [
            *nodes,
            helper.make_node("Mul", [scalar, "zero"], ["bomb_zero"]),
            helper.make_node("Add", ["logits_raw", "bomb_zero"], ["logits"]),
        ]
    )


def _constant_of_shape_bomb(model: onnx.ModelProto) -> None:
    model.graph.initializer.append(numpy_helper.from_array(np.array([FIVE_GB_FLOATS], np.int64), "bomb_shape"))
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    nodes = [
        helper.make_node("ConstantOfShape", ["bomb_shape"], ["bomb"], value=one),
        helper.make_node("ReduceSum", ["bomb"], ["bomb_sum"], keepdims=0),
    ]
    _into_logits(model, nodes, "bomb_sum")


def _expand_bomb(model: onnx.ModelProto) -> None:
    model.graph.initializer.append(numpy_helper.from_array(np.array([FIVE_GB_FLOATS, 1], np.int64), "bomb_shape"))
    nodes = [
        helper.make_node("ReduceMean", ["logits_raw"], ["bomb_seed"], keepdims=0),
        helper.make_node("Reshape", ["bomb_seed", "bomb_one_by_one"], ["bomb_cell"]),
        helper.make_node("Expand", ["bomb_cell", "bomb_shape"], ["bomb"]),
        helper.make_node("ReduceSum", ["bomb"], ["bomb_sum"], keepdims=0),
    ]
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 1], np.int64), "bomb_one_by_one"))
    _into_logits(model, nodes, "bomb_sum")


def _concat_doubling_bomb(model: onnx.ModelProto, doublings: int = 24) -> None:
    """Logits [1, T, V] concatenated with themselves 24 times: 2^24 x their size, all from dynamic shapes."""
    nodes, previous = [], "logits_raw"
    for step in range(doublings):
        nodes.append(helper.make_node("Concat", [previous, previous], [f"bomb_{step}"], axis=2))
        previous = f"bomb_{step}"
    nodes.append(helper.make_node("ReduceSum", [previous], ["bomb_sum"], keepdims=0))
    _into_logits(model, nodes, "bomb_sum")


def _matmul_chain(model: onnx.ModelProto, length: int = 200, size: int = 2048) -> None:
    """200 MatMuls of 2048x2048 (17 GFLOP each). Their weight is the identity times a 1 computed from
    the input, so nothing is folded or prepacked at load: the time goes into the run."""
    model.graph.initializer.append(numpy_helper.from_array(np.eye(size, dtype=np.float32), "chain_eye"))
    model.graph.initializer.append(numpy_helper.from_array(np.ones((), np.float32), "chain_one"))
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["chain_ids"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["chain_ids"], ["chain_sum_ids"], keepdims=0),
        helper.make_node("Mul", ["chain_sum_ids", "zero"], ["chain_nothing"]),
        helper.make_node("Add", ["chain_nothing", "chain_one"], ["chain_unit"]),
        helper.make_node("Mul", ["chain_eye", "chain_unit"], ["chain_0"]),
    ]
    for step in range(length):
        nodes.append(helper.make_node("MatMul", [f"chain_{step}", "chain_0"], [f"chain_{step + 1}"]))
    nodes.append(helper.make_node("ReduceSum", [f"chain_{length}"], ["chain_sum"], keepdims=0))
    _into_logits(model, nodes, "chain_sum")


def _forge(tiny_bundle: Path, tmp_path: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    return make_bad(tiny_bundle, tmp_path, lambda root: edit_engine(root, "decode_full", edit))


def _assert_bounded(outcome: Outcome, *fragments: str) -> None:
    assert_one_error_line(outcome, *fragments)
    assert outcome.peak_rss_mb < 1024, f"peak RSS {outcome.peak_rss_mb:.0f} MB"


@pytest.mark.parametrize(
    "bomb,fragments",
    [
        (_constant_of_shape_bomb, ("is refused", "ConstantOfShape")),
        (_expand_bomb, ("is refused", "Expand")),
    ],
    ids=["constant_of_shape_5gb", "expand_5gb"],
)
def test_constant_shaped_bombs_are_refused_by_the_graph_policy(
    bomb, fragments: tuple[str, ...], tiny_bundle: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    outcome = finish(start_cli(["run", str(_forge(tiny_bundle, tmp_path, bomb)), *PROMPT]), started)
    _assert_bounded(outcome, *fragments)


def test_a_concat_doubling_bomb_is_stopped_by_the_memory_ceiling(tiny_bundle: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    outcome = finish(start_cli(["run", str(_forge(tiny_bundle, tmp_path, _concat_doubling_bomb)), *PROMPT]), started)
    _assert_bounded(outcome, "needed more memory than the", "MB its bundle's dimensions allow")


def test_a_200_matmul_chain_is_stopped_by_the_time_bound(tiny_bundle: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    outcome = finish(start_cli(["run", str(_forge(tiny_bundle, tmp_path, _matmul_chain)), *PROMPT]), started)
    _assert_bounded(outcome, "ran past its time bound of 5.0 s")


def _computing(pid: int, threads: int = 2) -> bool:
    """True while at least `threads` of the process's threads are running (an engine run;
    the interpreter's start-up and imports use one)."""
    running = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            running += (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue
    return running >= threads


def test_sigint_during_a_long_engine_run_exits_130_within_2_s(tiny_bundle: Path, tmp_path: Path) -> None:
    bad = _forge(tiny_bundle, tmp_path, _matmul_chain)
    started = time.monotonic()
    proc = start_cli(["run", str(bad), *PROMPT])
    seen = 0  # consecutive samples: start-up can show two running threads for a moment, an engine run keeps them
    while seen < 10 and time.monotonic() - started < 15 and proc.poll() is None:
        seen = seen + 1 if _computing(proc.pid) else 0
        time.sleep(0.05)
    assert proc.poll() is None and seen == 10, "the engine run never started"
    interrupted = time.monotonic()
    proc.send_signal(signal.SIGINT)
    outcome = finish(proc, started, deadline=interrupted + 2.0)
    assert time.monotonic() - interrupted < 2.0
    assert_one_error_line(outcome, "interrupted", rc=130)


def test_a_ceiling_past_the_machine_memory_is_refused_before_the_run(tiny_bundle: Path, tmp_path: Path) -> None:
    """The arena ceiling follows the manifest's max_len: the tiny bundle claiming 65,536 positions
    may allocate hundreds of GiB, more than this machine has, and is refused in one line before any
    session starts (it used to grow until an outside limit or the OOM killer stopped it)."""

    def claim_max_len(data: dict[str, Any]) -> None:
        data["max_len"] = 1 << 16

    started = time.monotonic()
    outcome = finish(start_cli(["run", str(make_bad(tiny_bundle, tmp_path, manifest=claim_max_len)), *PROMPT]), started)
    _assert_bounded(outcome, "may allocate up to", "max_len of 65536", "--max-len")


def test_the_ceiling_check_passes_a_bundle_as_built(tiny_bundle: Path) -> None:
    from adaptive_export.runtimes import limits, load_bundle
    from adaptive_export.runtimes.backends.run_guard import check_ceiling_fits, engine_memory_ceiling

    manifest = load_bundle(tiny_bundle).manifest
    check_ceiling_fits(manifest, 1 << 20)
    available = limits.machine_memory()
    assert available is None or engine_memory_ceiling(manifest, 1 << 20) < available
