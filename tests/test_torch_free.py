"""The runtime and the `run` / `inspect` commands work with torch and transformers unimportable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# onnx is not blocked: it is a core runtime dependency (runtimes/graph_policy.py parses every
# engine with it before ONNX Runtime sees it); it does not import torch.
BLOCKER = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'optimum', 'onnxscript', 'jinja2'):
            raise ImportError(f'{name} is blocked in this test')
sys.meta_path.insert(0, Block())
"""


def run_blocked(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_generator_runs_without_torch(tiny_bundle: Path) -> None:
    code = f"""
from adaptive_export.runtimes import Generator
gen = Generator({str(tiny_bundle)!r})
result = gen.generate('The quick brown fox', max_new_tokens=5, raw=True)
assert len(result.tokens) >= 1
assert not any(m.split('.')[0] in ('torch', 'transformers') for m in sys.modules), 'torch leaked'
print('ok', result.tokens)
"""
    proc = run_blocked(code, Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")


def test_cli_run_and_inspect_without_torch(tiny_bundle: Path) -> None:
    code = f"""
from adaptive_export.commands.cli import main
rc = main(['run', {str(tiny_bundle)!r}, '-p', 'What is the capital of France?', '--max-new-tokens', '4', '--json'])
assert rc == 0
rc = main(['inspect', {str(tiny_bundle)!r}, '--json'])
assert rc == 0
"""
    proc = run_blocked(code, Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr
    first = json.loads(proc.stdout.splitlines()[0])
    assert set(first) >= {"text", "tokens", "prompt_tokens", "stats"}
    assert {"prefill_ms", "tpot_ms", "new_tokens"} <= set(first["stats"])
