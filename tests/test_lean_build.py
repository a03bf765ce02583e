"""The memory-lean build (loading/lean_model.py, exporter/lean_export.py) on the real SmolLM2:
the weights transformers loads, read one tensor at a time; a bundle equal, tensor by tensor and
node by node, to the one the full fp32 load makes; a fraction of its peak memory; and the
memory preflight's one error line, before any work, when a build cannot fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.conftest import needs_smollm2

pytestmark = [needs_smollm2, pytest.mark.slow, pytest.mark.timeout(1800)]

# `build` with the streaming path switched off: the full fp32 load, as before the lean build
FULL_LOAD_BUILD = (
    'import sys; from adaptive_export.commands import build; build.build_path = lambda options, checked: "full"; '
    "from adaptive_export.commands.cli import main; sys.exit(main(sys.argv[1:]))"
)
CLI = "import sys; from adaptive_export.commands.cli import main; sys.exit(main(sys.argv[1:]))"


PEAK = "peak-rss-kib "
# VmHWM, not ru_maxrss: Linux carries the forking parent's high-water mark into the child's
# ru_maxrss across exec (tests/bounded.py), so a test process that holds a model (a session
# fixture) would inflate every child's peak; VmHWM is the child's own address space's
REPORT_PEAK = (
    "import atexit; atexit.register(lambda: print("
    f"{PEAK!r} + next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')),"
    " file=sys.stderr)); "
)


def run_measured(code: str, *args: str, rlimit_data: int | None = None) -> tuple[subprocess.CompletedProcess, int]:
    """Run `python -c code args` in a child that reports its own peak RSS at exit; (the process with
    that report taken out of stderr, the peak in bytes)."""
    import resource

    def limit() -> None:
        if rlimit_data is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (rlimit_data, rlimit_data))

    proc = subprocess.run(
        [sys.executable, "-c", "import sys; " + REPORT_PEAK + code, *args],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        env={**os.environ, "TQDM_DISABLE": "1"},
        timeout=1500,
    )
    lines = proc.stderr.splitlines()
    peaks = [int(line[len(PEAK) :]) * 1024 for line in lines if line.startswith(PEAK)]
    stderr = "\n".join(line for line in lines if not line.startswith(PEAK))
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout, stderr), (peaks or [0])[0]


def tensors(bundle: Path) -> dict[str, bytes]:
    manifest = json.loads((bundle / "manifest.json").read_text())
    raw = np.memmap(bundle / "onnx" / "weights.bin", np.uint8, "r")
    return {
        name: bytes(raw[entry["offset"] : entry["offset"] + entry["bytes"]])
        for name, entry in manifest["backends"]["onnx"]["tensors"].items()
    }


def wiring(bundle: Path, graph: str) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    manifest = json.loads((bundle / "manifest.json").read_text())
    engine = manifest["backends"]["onnx"]["graphs"][graph]["file"]
    model = onnx.load(str(bundle / engine), load_external_data=False)
    return [(n.op_type, tuple(n.input), tuple(n.output)) for n in model.graph.node]


def test_gguf_weights_are_what_transformers_loads(smol_transformers_model) -> None:  # type: ignore[no-untyped-def]
    """Every parameter read on demand equals, bit for bit, the one from_pretrained(gguf_file=...)
    fills (transformers' own load: `load_model` now streams through GGUFWeights itself, so
    comparing with it could not fail)."""
    from adaptive_export.loading.gguf_weights import GGUFWeights
    from adaptive_export.loading.model import smollm2_gguf_path

    weights = GGUFWeights(smollm2_gguf_path(), smol_transformers_model)
    for name, parameter in smol_transformers_model.named_parameters():
        assert np.array_equal(weights.array(name), parameter.detach().numpy()), name


def test_lean_bundle_equals_the_full_load_bundle(tmp_path: Path) -> None:
    """The default build streams: the same tensors under the same names and the same graphs, node
    for node, as the full fp32 load, at under half its peak memory (the measured 0.78 vs 2.4 GB)."""
    assert_streamed_equals_full(tmp_path, "--max-len", "256", lean_share=0.5)


@pytest.mark.heavy
def test_a_calibrated_build_streams_its_export(tmp_path: Path) -> None:
    """A build that calibrates on the fp32 model (here early exit at layer 20, draft length 3) lets
    the model go and streams its export: the same bundle as the full load, draft and verify graphs
    included, at under 60% of its peak (measured 0.98 vs 2.23 GB, Zen 3)."""
    assert_streamed_equals_full(tmp_path, "--max-len", "256", "--speculate", "20:3", lean_share=0.6)


@pytest.mark.heavy
def test_a_build_with_a_head_file_streams_its_export(tmp_path: Path) -> None:
    """An EAGLE head from a file (what `build` of a packaged model takes from samples/heads/) needs
    no fp32 model: its trimmed LM head rows are read from the .gguf row by row, and the bundle
    equals the full load's, the head's graph and tensors included."""
    import torch

    from adaptive_export.calibration.drafts.eagle import EagleFit, eagle_bytes
    from adaptive_export.graphs.drafts.eagle import EagleBlock, pack

    torch.manual_seed(0)
    block = EagleBlock(576, 1152, 1e-5)  # SmolLM2's hidden size, the head's default width
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(std=0.02)
    ids = torch.arange(5, 5 + 3 * 64, 3)  # 64 ascending ids
    head = tmp_path / "head.safetensors"
    head.write_bytes(eagle_bytes(EagleFit(pack(block), ids, {"acceptance_own_text": 0.3})))
    flags = ("--max-len", "256", "--eagle-head", str(head), "--prompt-rows", "rule")
    assert_streamed_equals_full(tmp_path, *flags, lean_share=0.5)
    # check's first line still rebuilds the guessing graph (the head from the bundle's own file)
    from adaptive_export.exporter.check_structure import structure_rows
    from adaptive_export.runtimes.bundle import load_bundle

    rows = structure_rows(load_bundle(tmp_path / "lean"), "smollm2")
    assert rows and all(row.passed and row.executed for row in rows), rows


def assert_streamed_equals_full(tmp_path: Path, *flags: str, lean_share: float) -> None:
    lean, full = tmp_path / "lean", tmp_path / "full"
    lean_proc, lean_peak = run_measured(CLI, "build", "smollm2", *flags, "-o", str(lean))
    assert lean_proc.returncode == 0, lean_proc.stderr[-3000:]
    full_proc, full_peak = run_measured(FULL_LOAD_BUILD, "build", "smollm2", *flags, "-o", str(full))
    assert full_proc.returncode == 0, full_proc.stderr[-3000:]
    lean_tensors, full_tensors = tensors(lean), tensors(full)
    assert lean_tensors.keys() == full_tensors.keys()
    assert [n for n in lean_tensors if lean_tensors[n] != full_tensors[n]] == []
    graphs = json.loads((lean / "manifest.json").read_text())["graphs"]
    for graph in graphs:
        assert wiring(lean, graph) == wiring(full, graph), graph
    assert lean_peak < lean_share * full_peak, (lean_peak, full_peak)


def test_a_build_that_cannot_fit_is_one_line_before_any_work(tmp_path: Path) -> None:
    """Under a 1.5 GiB data limit, a full-load build (int8 re-quantization: ~3 GiB for SmolLM2) is
    refused with the estimate, exit 2, before it loads anything; nothing is written."""
    out = tmp_path / "out"
    proc, _ = run_measured(CLI, "build", "smollm2", "--quantize", "int8", "-o", str(out), rlimit_data=int(1.5 * 2**30))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: the build needs about "), lines
    assert "GiB are available" in lines[0] and "streams the weights" in lines[0]
    assert not out.exists() and not list(tmp_path.glob("*.partial*"))
