"""ONNX Runtime's CUDA execution provider: every engine and greedy decoding against PyTorch on a GPU.

The GPU tests run where onnxruntime-gpu can start CUDA (a lent GPU machine, `pip install
adaptive-export[gpu]`); CI machines have no GPU, so there they skip with the reason. What runs
everywhere: asking for a provider this machine lacks is one error line, exit 2, no report written.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnxruntime as ort
import pytest

from adaptive_export.commands.cli import main
from adaptive_export.runtimes import Generator, load_bundle
from adaptive_export.runtimes.backends import PROVIDERS

HAS_CUDA = PROVIDERS["cuda"] in ort.get_available_providers()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="onnxruntime-gpu's CUDA provider is not installed (CI machines have no GPU)"
)
FLAVOURS = ["tiny_bundle", "tiny_portable_bundle"]  # fused ONNX Runtime ops (contrib kernels) and standard ops


@needs_cuda
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_check_passes_on_cuda(
    flavour: str, request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`check --provider cuda`: every engine's parity, greedy identity of every configuration and draft source."""
    bundle = request.getfixturevalue(flavour)
    report = tmp_path / "cuda.json"
    code = main(["check", str(bundle), "--model", str(tiny_model_dir), "--provider", "cuda", "--report", str(report)])
    data = json.loads(report.read_text())
    failed = [r for r in data["results"] if not r["passed"]]
    assert code == 0 and data["provider"] == "cuda", failed
    parity = [r for r in data["results"] if r["check"] == "parity"]
    assert parity and all(r["executed"] for r in parity)


@needs_cuda
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_engines_run_on_cuda_and_decode_as_on_the_cpu(flavour: str, request: pytest.FixtureRequest) -> None:
    """The sessions hold the CUDA provider (no silent CPU fallback) and give the CPU's greedy tokens."""
    bundle = load_bundle(request.getfixturevalue(flavour))
    prompt = "The quick brown fox"
    cuda = Generator(bundle, provider="cuda")
    on_gpu = cuda.generate(prompt, mode="ar", max_new_tokens=24, raw=True).tokens
    sessions = cuda.backend.inner._sessions.values()
    assert sessions and all(s.get_providers()[0] == PROVIDERS["cuda"] for s in sessions)
    assert on_gpu == Generator(bundle).generate(prompt, mode="ar", max_new_tokens=24, raw=True).tokens


@pytest.mark.parametrize("command", ["check", "run", "bench"])
def test_a_provider_missing_here_is_one_error_line(
    command: str, tiny_bundle: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    available = ort.get_available_providers()
    missing = [name for name, provider in PROVIDERS.items() if provider not in available]
    if not missing:
        pytest.skip("this onnxruntime lists every provider")
    report = tmp_path / "r.json"
    rest = {
        "check": ["--model", str(tiny_model_dir), "--report", str(report)],
        "run": ["-p", "Hello", "--max-new-tokens", "2"],
        "bench": ["--repeat", "1", "--max-new-tokens", "2"],
    }[command]
    code = main([command, str(tiny_bundle), "--provider", missing[0], *rest])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ONNX Runtime provider"), err
    assert "Fix: " in err[0] and not report.exists() and not captured.out


@needs_cuda
def test_bench_on_cuda_reports_the_provider(tiny_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", str(tiny_bundle), "--provider", "cuda", "--repeat", "2", "--max-new-tokens", "8", "--json"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and row["provider"] == "cuda" and row["new_tokens"] == 8 and row["tpot_ms"] > 0


@pytest.mark.skipif(
    PROVIDERS["tensorrt"] not in ort.get_available_providers(),
    reason="this onnxruntime has no TensorRT provider (onnxruntime-gpu has one; CI machines have no GPU)",
)
def test_tensorrt_provider_decodes_as_the_cpu_or_is_refused(tiny_portable_bundle: Path) -> None:
    """onnxruntime-gpu lists TensorRT even where TensorRT's libraries are missing, and its Python API then
    falls back to CUDA or the CPU with a warning: `--provider tensorrt` runs on TensorRT or is refused."""
    from adaptive_export.runtimes.errors import UsageError

    bundle = load_bundle(tiny_portable_bundle)
    prompt = "The quick brown fox"
    try:
        tokens = Generator(bundle, provider="tensorrt").generate(prompt, mode="ar", max_new_tokens=16, raw=True).tokens
    except UsageError as exc:
        assert "could not start TensorrtExecutionProvider" in str(exc), exc
        return
    assert tokens == Generator(bundle).generate(prompt, mode="ar", max_new_tokens=16, raw=True).tokens
