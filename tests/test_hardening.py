"""Hostile bundles and arguments (issue #16): every case exits 2 with one `error: ... Fix: ...`
line, no traceback, within 10 s and 1 GB RSS, and never reads a sentinel file outside the
bundle. Each malicious bundle is built here from the tiny bundle with its checksums
recomputed, so only the check under test can refuse it.

Cases run in a child process (`run_isolated`) when time, memory, a hang or a file read
is what is checked: the child installs a Python audit hook that reports any open of the
sentinel, and its peak RSS comes from wait4. The rest run in-process through main().
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from adaptive_export.commands.cli import main
from tests.bounded import (
    SENTINEL_TEXT,
    plant_sentinel,
    run_cli_bounded,
    sentinel_in_tokens,
    sentinel_was_read,
)

LIMIT_S, LIMIT_RSS_MB = 10.0, 1024


# ---- helpers -----------------------------------------------------------------------------
def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resign(root: Path, manifest: dict[str, Any] | None = None) -> None:
    """Recompute size and sha256 of every listed regular file, as an attacker would."""
    manifest = manifest if manifest is not None else json.loads((root / "manifest.json").read_text())
    for relative, entry in manifest["files"].items():
        path = root / relative
        if isinstance(entry, dict) and path.is_file() and not path.is_symlink():
            entry.update(sha256=sha256(path), bytes=path.stat().st_size)
    (root / "manifest.json").write_text(json.dumps(manifest))


def make_bad(
    bundle: Path,
    tmp_path: Path,
    files: Callable[[Path], None] | None = None,
    manifest: Callable[[dict[str, Any]], None] | None = None,
    sign: bool = True,
) -> Path:
    copy = tmp_path / "bad"
    shutil.copytree(bundle, copy)
    if files:
        files(copy)
    data = json.loads((copy / "manifest.json").read_text())
    if manifest:
        manifest(data)
    if sign:
        resign(copy, data)
    else:
        (copy / "manifest.json").write_text(json.dumps(data))
    return copy


def sentinel(tmp_path: Path, size: int = 0) -> Path:
    return plant_sentinel(tmp_path / "SENTINEL_outside.bin", size)


def run_isolated(argv: list[str], sentinel_path: Path | None = None, timeout: float = LIMIT_S) -> tuple[int, str, str]:
    """Run the CLI in a bounded child (tests/bounded.py): returns (exit code, stdout, stderr) after
    checking the time, memory, one-line and no-read rules."""
    outcome = run_cli_bounded(argv, sentinel_path.name if sentinel_path else "no-sentinel-marker", timeout)
    text_out, text_err = outcome.out, outcome.err
    assert outcome.seconds < timeout + 8, f"took {outcome.seconds:.1f} s"  # + a fresh interpreter's start-up
    assert outcome.peak_rss_mb < LIMIT_RSS_MB, f"peak RSS {outcome.peak_rss_mb:.0f} MB"
    assert "AUDIT" not in text_err, text_err
    if sentinel_path is not None:
        assert SENTINEL_TEXT.decode() not in text_out + text_err, "sentinel bytes leaked"
        assert not sentinel_was_read(sentinel_path), "the sentinel outside the bundle was read"
        for line in text_out.splitlines():
            if line.startswith("{"):
                assert not sentinel_in_tokens(json.loads(line).get("tokens", [])), "sentinel bytes became tokens"
    return outcome.rc, text_out, text_err


def assert_one_line(rc: int, err: str, *fragments: str, progress: bool = False) -> None:
    """Exit 2 and exactly one line on stderr (`check` may also draw its documented progress bars)."""
    assert rc == 2, err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    if progress:
        lines = [line for line in lines if "%|" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Fix:" in lines[0], err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


def expect_usage(argv: list[str], capsys: pytest.CaptureFixture[str], *fragments: str) -> str:
    started = time.monotonic()
    rc = main(argv)
    err = capsys.readouterr().err
    assert_one_line(rc, err, *fragments, progress=argv[0] == "check")
    assert time.monotonic() - started < LIMIT_S
    return err


def engine_file(root: Path, graph: str) -> str:
    """The bundle-relative engine file of `graph` (fused bundles share one file between prefill
    and the full model's decode graph)."""
    return json.loads((root / "manifest.json").read_text())["backends"]["onnx"]["graphs"][graph]["file"]


def edit_engine(root: Path, graph: str, edit: Callable[[onnx.ModelProto], None]) -> None:
    path = root / engine_file(root, graph)
    model = onnx.load(str(path), load_external_data=False)
    edit(model)
    path.write_bytes(model.SerializeToString())


def external_tensor(name: str, dims: list[int]) -> TensorProto:
    tensor = TensorProto()
    tensor.name, tensor.data_type = name, TensorProto.FLOAT
    tensor.dims.extend(dims)
    return tensor


def leak_into_logits(model: onnx.ModelProto, location: str, vocab: int, name: str = "leak") -> None:
    """Add a [1, 1, V] float tensor read from `location` to the logits: if the engine ran,
    the file's bytes would steer the output tokens."""
    tensor = external_tensor(name, [1, 1, vocab])
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(vocab * 4))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    model.graph.initializer.append(tensor)
    for node in model.graph.node:
        for index, output in enumerate(node.output):
            if output == "logits":
                node.output[index] = "logits_raw"
    model.graph.node.append(helper.make_node("Add", ["logits_raw", name], ["logits"]))


def vocab_of(bundle: Path) -> int:
    return json.loads((bundle / "manifest.json").read_text())["model"]["vocab_size"]


# ---- reads outside the bundle --------------------------------------------------------------
@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink_in_bundle", "unlisted_name_of_weights"])
def test_external_data_outside_the_bundle_is_refused_before_loading(
    where: str, tiny_bundle: Path, tmp_path: Path
) -> None:
    vocab = vocab_of(tiny_bundle)
    secret = sentinel(tmp_path, vocab * 4)

    def files(root: Path) -> None:
        location = {
            "dotdot": "../../SENTINEL_outside.bin",
            "absolute": str(secret),
            "symlink_in_bundle": "cache.bin",
            "unlisted_name_of_weights": "weights.bin",
        }[where]
        if where == "symlink_in_bundle":
            os.symlink(secret, root / "onnx" / "cache.bin")
        edit_engine(root, "decode_full", lambda m: leak_into_logits(m, location, vocab))

    bad = make_bad(tiny_bundle, tmp_path, files)
    rc, _, err = run_isolated(["run", str(bad), "-p", "The sea", "--max-new-tokens", "4"], secret)
    assert_one_line(rc, err, engine_file(tiny_bundle, "decode_full"), "is refused")


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink_in_bundle"])
def test_pinned_onnxruntime_refuses_external_data_outside_the_engine_folder(
    where: str, tiny_bundle: Path, tmp_path: Path
) -> None:
    """Defence in depth: with the runtime's own policy bypassed, ONNX Runtime (pinned in
    pyproject.toml) still refuses, given the session setup of the onnx backend."""
    import onnxruntime as ort

    from adaptive_export.runtimes import load_bundle

    vocab = vocab_of(tiny_bundle)
    secret = sentinel(tmp_path, vocab * 4)
    bundle = load_bundle(make_bad(tiny_bundle, tmp_path), verify="size")
    if where == "symlink_in_bundle":
        os.symlink(secret, bundle.root / "onnx" / "cache.bin")
    location = {"dotdot": "../../SENTINEL_outside.bin", "absolute": str(secret), "symlink_in_bundle": "cache.bin"}[
        where
    ]
    model = onnx.load(str(bundle.root / engine_file(bundle.root, "decode_full")), load_external_data=False)
    leak_into_logits(model, location, vocab)
    entry = bundle.backend_entry("onnx")
    weights = np.fromfile(bundle.root / entry.weights, dtype=np.uint8)
    options, values = ort.SessionOptions(), []
    options.log_severity_level = 4
    for name in entry.graphs["decode_full"].initializers:
        meta = entry.tensors[name]
        values.append(
            ort.OrtValue.ortvalue_from_numpy(
                weights[meta.offset : meta.offset + meta.bytes].view(meta.dtype).reshape(meta.shape)
            )
        )
        options.add_initializer(name, values[-1])
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(bundle.root / "onnx"))
    with pytest.raises(Exception, match="External data path"):
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_constant_with_external_data_is_refused(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = sentinel(tmp_path, 64)

    def edit(model: onnx.ModelProto) -> None:
        tensor = external_tensor("c", [16])
        tensor.data_location = TensorProto.EXTERNAL
        entry = tensor.external_data.add()
        entry.key, entry.value = "location", str(secret)
        model.graph.node.insert(0, helper.make_node("Constant", [], ["unused_c"], value=tensor))

    bad = make_bad(tiny_bundle, tmp_path, lambda r: edit_engine(r, "prefill", edit))
    expect_usage(["run", str(bad), "-p", "hi"], capsys, "constant refers to external data")


def test_manifest_symlink_to_outside_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    outside = tmp_path / "SENTINEL_outside.bin"

    def files(root: Path) -> None:
        shutil.move(root / "manifest.json", outside)
        os.symlink(outside, root / "manifest.json")

    copy = tmp_path / "bad"
    shutil.copytree(tiny_bundle, copy)
    files(copy)
    os.utime(outside, (outside.stat().st_mtime - 2 * 86400, outside.stat().st_mtime))  # a read would move it
    rc, _, err = run_isolated(["run", str(copy), "-p", "hi"], outside)
    assert_one_line(rc, err, "manifest", "symlinks")


def test_check_never_resolves_a_relative_model_source(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = make_bad(tiny_bundle, tmp_path, manifest=lambda m: m["model"].update(source="../../some/model"))
    expect_usage(["check", str(bad)], capsys, "relative path", "--model")


# ---- executable graphs ------------------------------------------------------------------------
def _loop_engine(model: onnx.ModelProto) -> None:
    """A Loop of 10^12 iterations in front of the logits."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Identity", ["x_in"], ["x_out"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_in", TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_out", TensorProto.FLOAT, None),
        ],
    )
    model.graph.initializer.extend(
        [
            helper.make_tensor("trip", TensorProto.INT64, [], [10**12]),
            helper.make_tensor("go", TensorProto.BOOL, [], [True]),
        ]
    )
    for node in model.graph.node:
        for index, output in enumerate(node.output):
            if output == "logits":
                node.output[index] = "logits_raw"
    model.graph.node.append(helper.make_node("Loop", ["trip", "go", "logits_raw"], ["logits"], body=body))


GRAPH_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "loop_1e12": (lambda r: edit_engine(r, "decode_full", _loop_engine), "is refused"),
    "custom_domain": (
        lambda r: edit_engine(
            r,
            "prefill",
            lambda m: (
                m.opset_import.append(helper.make_opsetid("evil.ops", 1)),
                m.graph.node.insert(0, helper.make_node("Spin", [], ["s"], domain="evil.ops")),
            ),
        ),
        "domain",
    ),
    "function": (
        lambda r: edit_engine(
            r,
            "prefill",
            lambda m: m.functions.append(
                helper.make_function(
                    "local",
                    "f",
                    ["a"],
                    ["b"],
                    [helper.make_node("Identity", ["a"], ["b"])],
                    [helper.make_opsetid("", 18)],
                )
            ),
        ),
        "functions",
    ),
    "renamed_input": (
        lambda r: edit_engine(r, "decode_full", lambda m: setattr(m.graph.input[0], "name", "tokens")),
        "inputs",
    ),
    "swapped_graphs": (
        lambda r: (
            shutil.move(r / "onnx" / "prefill.onnx", r / "tmp.onnx"),
            shutil.move(r / "onnx" / "decode_full.onnx", r / "onnx" / "prefill.onnx"),
            shutil.move(r / "tmp.onnx", r / "onnx" / "decode_full.onnx"),
        ),
        "logits",
    ),
    "sliced_logits": (
        lambda r: edit_engine(
            r,
            "decode_full",
            lambda m: setattr(
                next(o for o in m.graph.output if o.name == "logits").type.tensor_type.shape.dim[2], "dim_value", 7
            ),
        ),
        "logits",
    ),
    "float16_kv": (
        lambda r: edit_engine(
            r,
            "decode_full",
            lambda m: setattr(
                next(i for i in m.graph.input if i.name == "past_key_0").type.tensor_type,
                "elem_type",
                TensorProto.FLOAT16,
            ),
        ),
        "past_key_0",
    ),
}


# Cases built on the portable flavour, whose prefill and decode are two engine files (a fused
# bundle's are one file, so there is nothing to swap).
PORTABLE_CASES = {"swapped_graphs"}


@pytest.mark.parametrize(
    "case", sorted(set(GRAPH_CASES) - {"loop_1e12"})
)  # the Loop runs in a child (a regression would hang)
def test_engines_outside_the_graph_policy_are_refused(
    case: str, tiny_bundle: Path, tiny_portable_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mutate, fragment = GRAPH_CASES[case]
    bad = make_bad(tiny_portable_bundle if case in PORTABLE_CASES else tiny_bundle, tmp_path, mutate)
    expect_usage(["run", str(bad), "-p", "The sea", "--max-new-tokens", "2"], capsys, "is refused", fragment)


def test_an_engine_of_the_other_flavour_is_refused(
    tiny_bundle: Path, tiny_portable_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A portable decode engine in place of the fused one: its I/O is not the manifest's."""
    portable = tiny_portable_bundle / engine_file(tiny_portable_bundle, "decode_full")
    bad = make_bad(tiny_bundle, tmp_path, lambda r: shutil.copy(portable, r / engine_file(r, "decode_full")))
    expect_usage(["run", str(bad), "-p", "The sea", "--max-new-tokens", "2"], capsys, "is refused", "inputs")


def test_loop_engine_is_refused_in_a_child_within_bounds(tiny_bundle: Path, tmp_path: Path) -> None:
    bad = make_bad(tiny_bundle, tmp_path, GRAPH_CASES["loop_1e12"][0])
    rc, _, err = run_isolated(["run", str(bad), "-p", "The sea", "--max-new-tokens", "2"])
    assert_one_line(rc, err, "Loop")


def test_wrong_kv_heads_in_the_manifest_are_refused(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = make_bad(tiny_bundle, tmp_path, manifest=lambda m: m["model"].update(num_kv_heads=1))
    expect_usage(["run", str(bad), "-p", "hi"], capsys, "past_key_0", "shape")


def test_check_exits_2_not_1_on_a_refused_engine(
    tiny_portable_bundle: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = make_bad(tiny_portable_bundle, tmp_path, GRAPH_CASES["swapped_graphs"][0])
    expect_usage(["check", str(bad), "--model", str(tiny_model_dir), "--new-tokens", "2"], capsys, "is refused")


# ---- weights and tensors ----------------------------------------------------------------------
def _weights_meta(m: dict[str, Any], name: str) -> dict[str, Any]:
    return m["backends"]["onnx"]["tensors"][name]


def test_float16_weight_table_entry_is_refused(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def manifest(m: dict[str, Any]) -> None:
        meta = _weights_meta(m, "lm_head.weight")
        meta.update(dtype="<f2", bytes=meta["bytes"] // 2)

    bad = make_bad(tiny_bundle, tmp_path, manifest=manifest)
    expect_usage(["run", str(bad), "-p", "hi"], capsys, "lm_head.weight")


def test_shape_that_does_not_match_its_bytes_is_refused(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = make_bad(tiny_bundle, tmp_path, manifest=lambda m: _weights_meta(m, "lm_head.weight").update(shape=[7, 3]))
    expect_usage(["run", str(bad), "-p", "hi"], capsys, "is not", "bytes")


def test_a_weight_table_entry_naming_other_bytes_than_the_engine_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    """The runtime binds each weight at the table's offset: a table pointed at a copy appended to the
    weights file (the engine file untouched) is refused in one line naming the tensor, in a bounded child."""
    weights = tmp_path / "bad" / "onnx" / "weights.bin"

    def manifest(m: dict[str, Any]) -> None:
        meta = _weights_meta(m, "lm_head.weight")
        copy = bytearray(weights.read_bytes()[meta["offset"] : meta["offset"] + meta["bytes"]])
        copy[:4] = b"\x00\x00\x80\x7f"  # a different first weight: what the copy lets a bundle change
        with weights.open("ab") as handle:
            meta["offset"] = handle.tell()
            handle.write(bytes(copy))
        m["backends"]["onnx"]["weight_bytes"] = weights.stat().st_size

    bad = make_bad(tiny_bundle, tmp_path, manifest=manifest)
    rc, _, err = run_isolated(["run", str(bad), "-p", "hi", "--max-new-tokens", "2"])
    assert_one_line(rc, err, "'lm_head.weight'", "the weight table (what the runtime binds)")


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_nan_logits_are_a_usage_error(
    temperature: str, tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def files(root: Path) -> None:
        m = json.loads((root / "manifest.json").read_text())
        meta = _weights_meta(m, "lm_head.weight")
        weights = root / "onnx" / "weights.bin"
        data = bytearray(weights.read_bytes())
        data[meta["offset"] : meta["offset"] + meta["bytes"]] = np.full(
            meta["bytes"] // 4, np.nan, dtype=np.float32
        ).tobytes()
        weights.write_bytes(bytes(data))

    bad = make_bad(tiny_bundle, tmp_path, files)
    expect_usage(
        ["run", str(bad), "-p", "hi", "--temperature", temperature, "--seed", "1"], capsys, "non-finite logits"
    )


# ---- integrity: every opened file listed once ---------------------------------------------
# what `build --speculate auto` measured on SmolLM2's default (accuracy-4) bundle
EXACTNESS = {"max_logit_diff": 1.197, "logit_scale": 32.1, "top1_flips": 3, "worst_flip_margin": 0.136, "exact": False}
# SmolLM2's default bundle, two-row plain passes against one T=9 pass: bit-identical rows
EXACTNESS_TWO_ROWS = {**EXACTNESS, "max_logit_diff": 0.0, "top1_flips": 0, "worst_flip_margin": 0.0, "exact": True}
EXACTNESS_TWO_ROWS["plain_rows"] = 2
INTEGRITY_CASES: dict[str, tuple[Callable[[Path], None] | None, Callable[[dict[str, Any]], None] | None, str]] = {
    "weights_unlisted": (None, lambda m: m["files"].pop("onnx/weights.bin"), "not listed"),
    "weights_alias": (
        None,
        lambda m: m["files"].update({"onnx/./weights.bin": dict(m["files"]["onnx/weights.bin"])}),
        "canonical",
    ),
    "weights_hardlink": (
        lambda r: os.link(r / "onnx" / "weights.bin", r / "onnx" / "w2.bin"),
        lambda m: m["files"].update({"onnx/w2.bin": dict(m["files"]["onnx/weights.bin"])}),
        "same file",
    ),
    "tokenizer_unlisted": (None, lambda m: m["files"].pop("tokenizer.json"), "not listed"),
    "path_control_char": (
        lambda r: shutil.move(r / "tokenizer.json", r / "tok\u0085.json"),
        lambda m: (
            m["files"].update({"tok\u0085.json": m["files"].pop("tokenizer.json")}),
            m["tokenizer"].update(file="tok\u0085.json"),
        ),
        "control",
    ),
    "path_lone_surrogate": (None, lambda m: m["tokenizer"].update(file="tok\udc80.json"), "surrogate"),
    "graph_name_path": (None, lambda m: m["graphs"].update({"../x": m["graphs"]["decode_full"]}), "graph name"),
    "speculation_malformed": (
        None,
        lambda m: m.update(speculation={"prompt_lookup": "x"}),
        "speculation.prompt_lookup",
    ),
    "draft_len_huge": (
        None,
        lambda m: m.update(speculation={"source": "prompt_lookup", "prompt_lookup": {"draft_len": 10**9}}),
        "draft_len",
    ),
    "exactness_claims_exact": (  # SmolLM2's accuracy-4 measurement, claiming a verify pass reproduces plain steps
        None,
        lambda m: m.update(speculation={"verify_exactness": {**EXACTNESS, "exact": True}}),
        "contradicts its max_logit_diff",
    ),
    "exactness_not_bool": (
        None,
        lambda m: m.update(speculation={"verify_exactness": {**EXACTNESS, "exact": "no"}}),
        "exact must be true or false",
    ),
    "exactness_huge": (
        None,
        lambda m: m.update(speculation={"verify_exactness": {**EXACTNESS, "max_logit_diff": 1e300}}),
        "max_logit_diff must be a number",
    ),
    "exactness_negative_scale": (
        None,
        lambda m: m.update(speculation={"verify_exactness": {**EXACTNESS, "logit_scale": -32.1}}),
        "logit_scale",
    ),
    "exactness_flips_float": (
        None,
        lambda m: m.update(speculation={"verify_exactness": {**EXACTNESS, "top1_flips": 2.5}}),
        "top1_flips",
    ),
    "two_rows_unmeasured": (  # a bundle may decode two rows at least only where that was measured exact
        None,
        lambda m: m.update(speculation={"min_decode_rows": 2}),
        "without an exact multi_row_exactness",
    ),
    "two_rows_measured_inexact": (
        None,
        lambda m: m.update(speculation={"min_decode_rows": 2, "multi_row_exactness": {**EXACTNESS, "plain_rows": 2}}),
        "without an exact multi_row_exactness",
    ),
    "two_rows_measured_on_one_row": (
        None,
        lambda m: m.update(speculation={"multi_row_exactness": {**EXACTNESS_TWO_ROWS, "plain_rows": 1}}),
        "plain_rows must be 2",
    ),
    "decode_rows_huge": (
        None,
        lambda m: m.update(speculation={"min_decode_rows": 10**9, "multi_row_exactness": EXACTNESS_TWO_ROWS}),
        "min_decode_rows must be 1 or 2",
    ),
    "plain_rows_bool": (
        None,
        lambda m: m.update(speculation={"verify_exactness": {**EXACTNESS, "plain_rows": True}}),
        "plain_rows must be 1 or 2",
    ),
    "max_len_1e12": (None, lambda m: m.update(max_len=10**12), "max_len"),
    "num_layers_1e9": (None, lambda m: m["model"].update(num_layers=10**9), "num_layers"),
    "vocab_1e12": (None, lambda m: m["model"].update(vocab_size=10**12), "vocab_size"),
    "chat_prefix_huge": (None, lambda m: m["tokenizer"].update(chat={"prefix": "x" * 200_000, "suffix": ""}), "chat"),
    "decode_logits_last": (None, lambda m: m["graphs"]["decode_full"].update(logits="last"), "every row"),
    "kept_twice": (None, lambda m: m["configs"][0].update(kept=[0, 0, 1, 2, 3]), "kept layer list"),
    "decode_from_hidden": (None, lambda m: m["graphs"]["decode_full"].update(source="hidden"), "source"),
    "weights_beyond_file": (
        None,
        lambda m: m["backends"]["onnx"]["tensors"]["lm_head.weight"].update(offset=10**9),
        "outside the weights file",
    ),
    "manifest_is_directory": (
        lambda r: ((r / "manifest.json").unlink(), (r / "manifest.json").mkdir()),
        None,
        "not a regular file",
    ),
    "onnx_dir_symlink_out": (
        lambda r: (
            shutil.move(r / "onnx", r.parent / "onnx_outside"),
            os.symlink(r.parent / "onnx_outside", r / "onnx"),
        ),
        None,
        "outside the bundle",
    ),
    "tokenizer_malformed": (
        lambda r: (r / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 5}}'),
        None,
        "tokenizer",
    ),
}


# dimensions of 10^9..10^12: a regression would allocate or loop, so these run in a bounded child
HUGE_DIMENSION_CASES = {"draft_len_huge", "max_len_1e12", "num_layers_1e9", "vocab_1e12", "weights_beyond_file"}


@pytest.mark.parametrize("case", sorted(HUGE_DIMENSION_CASES))
def test_huge_dimensions_are_refused_in_a_bounded_child(case: str, tiny_bundle: Path, tmp_path: Path) -> None:
    files, manifest, fragment = INTEGRITY_CASES[case]
    bad = make_bad(tiny_bundle, tmp_path, files, manifest)
    rc, _, err = run_isolated(["run", str(bad), "-p", "hi", "--mode", "auto", "--verify", "full"])
    assert_one_line(rc, err, fragment)


@pytest.mark.parametrize("case", sorted(set(INTEGRITY_CASES) - HUGE_DIMENSION_CASES))
def test_integrity_and_manifest_bounds(
    case: str, tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files, manifest, fragment = INTEGRITY_CASES[case]
    if case == "manifest_is_directory":  # nothing to re-sign: the manifest is gone
        bad = tmp_path / "bad"
        shutil.copytree(tiny_bundle, bad)
        files(bad)
    else:
        bad = make_bad(tiny_bundle, tmp_path, files, manifest)
    expect_usage(["run", str(bad), "-p", "hi", "--mode", "auto", "--verify", "full"], capsys, fragment)


def test_unlisted_weights_are_never_used_even_when_corrupt(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: weights.bin left out of 'files' and corrupted still loaded under --verify full."""

    def files(root: Path) -> None:
        weights = root / "onnx" / "weights.bin"
        weights.write_bytes(b"\xff" * weights.stat().st_size)

    bad = make_bad(tiny_bundle, tmp_path, files, lambda m: m["files"].pop("onnx/weights.bin"))
    expect_usage(["run", str(bad), "-p", "hi", "--verify", "full"], capsys, "weights.bin", "not listed")


def test_duplicate_json_key_is_refused(tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = make_bad(tiny_bundle, tmp_path)
    text = (copy / "manifest.json").read_text()
    entry = json.dumps(json.loads(text)["files"]["onnx/weights.bin"])
    (copy / "manifest.json").write_text(text.replace('"files": {', '"files": {"onnx/weights.bin": ' + entry + ", ", 1))
    expect_usage(["run", str(copy), "-p", "hi"], capsys, "appears twice")


def test_directory_in_place_of_the_tokenizer(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def files(root: Path) -> None:
        (root / "tokenizer.json").unlink()
        (root / "tokenizer.json").mkdir()

    bad = make_bad(tiny_bundle, tmp_path, files)
    expect_usage(["run", str(bad), "-p", "hi"], capsys, "tokenizer.json", "not a regular file")


def test_malformed_calibration_in_inspect(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def files(root: Path) -> None:
        (root / "calibration.json").write_text('{"configs": {"chosen": "x"}}')

    def manifest(m: dict[str, Any]) -> None:
        m["calibration"] = "calibration.json"
        m["files"]["calibration.json"] = {"sha256": "0" * 64, "bytes": 0}

    bad = make_bad(tiny_bundle, tmp_path, files, manifest)
    expect_usage(["inspect", str(bad)], capsys, "calibration.json", "malformed")


def test_weights_fifo_does_not_hang(tiny_bundle: Path, tmp_path: Path) -> None:
    def files(root: Path) -> None:
        (root / "onnx" / "weights.bin").unlink()
        os.mkfifo(root / "onnx" / "weights.bin")

    bad = make_bad(tiny_bundle, tmp_path, files, sign=False)
    rc, _, err = run_isolated(["run", str(bad), "-p", "hi", "--verify", "size"])
    assert_one_line(rc, err, "weights.bin", "not a regular file")


def test_kv_arena_is_checked_before_allocation() -> None:
    from adaptive_export.runtimes import UsageError
    from adaptive_export.runtimes.kv_arena import KVArena

    with pytest.raises(UsageError, match="KV arena needs"):
        KVArena(1024, 1 << 16, 64, 256)  # 128 GiB: refused without allocating


# ---- resources and arguments -------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["run", "{b}", "-p", "hi", "--threads", "100000"], "--threads 100000"),
        (["run", "{b}", "-p", "hi", "--threads", "-1"], "--threads -1"),
        (["run", "{b}", "-p", "hi", "--mode", "spec", "--draft-len", "1000000"], "--draft-len"),
        (["run", "{b}", "--prompt-file", "{t}/big.txt"], "more than the"),
        (["check", "{b}", "--tolerance", "inf"], "--tolerance inf"),
        (["check", "{b}", "--tolerance", "nan"], "--tolerance nan"),
        (["check", "{b}", "--tolerance", "-1"], "--tolerance -1"),
        (["build", "{t}/model", "-o", "{t}/o", "--max-len", "1000000000"], "--max-len"),
        (["bench", "{b}", "--threads", "100000"], "--threads"),
        (["check", "{b}", "--report", "{t}/missing-dir/r.json"], "--report"),
        (["bench", "{b}", "--repeat", "1000000000"], "--repeat"),
    ],
)
def test_resource_arguments_are_bounded(
    argv: list[str], fragment: str, tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "big.txt").write_bytes(b"a" * (5 << 20))
    expect_usage([a.format(b=tiny_bundle, t=tmp_path) for a in argv], capsys, fragment)


def test_dev_zero_prompt_file_is_refused_in_a_bounded_child(tiny_bundle: Path) -> None:
    rc, _, err = run_isolated(["run", str(tiny_bundle), "--prompt-file", "/dev/zero"])
    assert_one_line(rc, err, "not a regular file")


def test_prompt_fifo_does_not_hang(tiny_bundle: Path, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "prompt")
    rc, _, err = run_isolated(["run", str(tiny_bundle), "--prompt-file", str(tmp_path / "prompt")])
    assert_one_line(rc, err, "not a regular file")


def test_api_rejects_bytes_prompt_and_accepts_stop_none(tiny_bundle: Path) -> None:
    from adaptive_export.runtimes import Generator, SamplingParams, UsageError

    generator = Generator(tiny_bundle)
    with pytest.raises(UsageError, match="neither text nor"):
        generator.generate(b"hello", max_new_tokens=2)
    with pytest.raises(UsageError, match="stop must be"):
        generator.generate("hello", max_new_tokens=2, stop=[1, 2])
    with pytest.raises(UsageError, match="draft length"):
        generator.generate("hello", max_new_tokens=2, mode="spec", draft_len=10**6)
    assert len(generator.generate("hello", max_new_tokens=2, stop=None).tokens) <= 2
    tiny_temperature = generator.generate(
        "hello", max_new_tokens=2, sampling=SamplingParams(temperature=1e-320, seed=1)
    )
    assert tiny_temperature.tokens == generator.generate("hello", max_new_tokens=2).tokens  # the greedy limit, not NaN


# ---- gate and data safety at build time ----------------------------------------------------------
def test_force_never_replaces_the_model_or_the_working_directory(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = sorted(p.name for p in tiny_model_dir.iterdir())
    expect_usage(["build", str(tiny_model_dir), "-o", str(tiny_model_dir), "--force"], capsys, "never replaces")
    expect_usage(["build", str(tiny_model_dir), "-o", str(tiny_model_dir.parent), "--force"], capsys, "never replaces")
    assert sorted(p.name for p in tiny_model_dir.iterdir()) == before
    work = tmp_path / "work"
    (work / "keep").mkdir(parents=True)
    monkeypatch.chdir(work)
    expect_usage(["build", str(tiny_model_dir), "-o", ".", "--force"], capsys, "names no directory")
    expect_usage(["build", str(tiny_model_dir), "-o", str(tmp_path), "--force"], capsys, "never replaces")
    expect_usage(["build", str(tiny_model_dir), "-o", "keep", "--force"], capsys, "not an adaptive-export bundle")
    assert (work / "keep").is_dir() and not list(work.glob(".*partial*")) and not list(tmp_path.glob(".*partial*"))


def test_config_only_model_and_truncated_gguf_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "cfg"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "hidden_size": 32,
                "num_attention_heads": 2,
                "intermediate_size": 64,
                "vocab_size": 100,
                "rms_norm_eps": 1e-6,
            }
        )
    )
    expect_usage(["build", str(model), "-o", str(tmp_path / "o1")], capsys, "cannot load")
    gguf = tmp_path / "cut.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 11)
    expect_usage(["build", str(gguf), "-o", str(tmp_path / "o2")], capsys, "cut.gguf")


# ---- file sizes, checked before anything is hashed (runtimes/file_bounds.py) ------------------------
def _list_unhashed(root: Path, name: str, size: int) -> None:
    """List a sparse file of `size` bytes with a checksum nobody computed: a refusal that names the
    size, not the checksum, happened before hashing."""
    with open(root / name, "wb") as handle:
        handle.truncate(size)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": "0" * 64, "bytes": size}
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_four_16_gib_sparse_files_are_refused_in_under_a_second(tiny_bundle: Path, tmp_path: Path) -> None:
    """The issue's case: four unused but listed 16 GiB holes made `run` hash 64 GiB (66 s)."""

    def files(root: Path) -> None:
        for index in range(4):
            _list_unhashed(root, f"unused{index}.bin", 16 << 30)

    bad = make_bad(tiny_bundle, tmp_path, files, sign=False)
    baseline = run_cli_bounded(["run", str(tmp_path / "no-bundle"), "-p", "hi"])  # refused before any file
    outcome = run_cli_bounded(["run", str(bad), "-p", "hi", "--verify", "full"])
    assert_one_line(outcome.rc, outcome.err, "unused0.bin", "model's dimensions allow")
    assert outcome.seconds < baseline.seconds + 1.0, (outcome.seconds, baseline.seconds)


def test_a_sparse_file_within_the_size_caps_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    bad = make_bad(tiny_bundle, tmp_path, lambda r: _list_unhashed(r, "holes.bin", 8 << 20), sign=False)
    rc, _, err = run_isolated(["run", str(bad), "-p", "hi"])
    assert_one_line(rc, err, "holes.bin", "is sparse")


def test_oversize_weights_are_refused_before_hashing(tiny_bundle: Path, tmp_path: Path) -> None:
    """weights.bin far larger than a model of these dimensions needs: refused on its size, never hashed."""

    def files(root: Path) -> None:
        with open(root / "onnx" / "weights.bin", "r+b") as handle:
            handle.truncate(512 << 20)
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["files"]["onnx/weights.bin"] = {"sha256": "0" * 64, "bytes": 512 << 20}
        (root / "manifest.json").write_text(json.dumps(manifest))

    bad = make_bad(tiny_bundle, tmp_path, files, sign=False)
    rc, _, err = run_isolated(["run", str(bad), "-p", "hi", "--verify", "full"])
    assert_one_line(rc, err, "onnx/weights.bin", "model's dimensions allow")
    assert "checksum" not in err


def test_a_tampered_speculation_source_is_named_in_the_error(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manifest whose speculation.source names a source without engines here: `--mode spec` names
    that source (it said "has no None draft engines")."""
    bad = make_bad(tiny_bundle, tmp_path, manifest=lambda m: m.update(speculation={"source": "early_exit"}))
    err = expect_usage(["run", str(bad), "-p", "hi", "--mode", "spec"], capsys, "has no early_exit draft engines")
    assert "None" not in err
