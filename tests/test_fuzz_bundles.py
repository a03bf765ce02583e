"""Fuzz whole bundles, not just manifests: 1,000+ mutations per run of the tiny bundle (manifest
fields, engine graph I/O and ops, the file list, file types), each re-signed with consistent
checksums as an attacker would, then loaded AND run (Generator, a short generation, and
`inspect`'s description). Each case must end in a UsageError or a valid result, within a
time bound per case; RSS must stay bounded over the run.

Seeded: ADAPTIVE_EXPORT_FUZZ_SEED picks another sequence (failures print the seed and case).
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from adaptive_export.runtimes import Generator, UsageError, load_bundle
from adaptive_export.runtimes.bundle_summary import describe, render
from tests.test_hardening import resign
from tests.test_soak import rss_mb

CASES = int(os.environ.get("ADAPTIVE_EXPORT_FUZZ_CASES", "1000"))
SEED = int(os.environ.get("ADAPTIVE_EXPORT_FUZZ_SEED", "16"))
CASE_LIMIT_S = 10.0
RSS_GROWTH_LIMIT_MB = 400

JSON_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    7,
    10**12,
    -(10**12),
    0.5,
    1e308,
    "",
    "x",
    "full",
    "prefill",
    "../x",
    "/etc/passwd",
    "onnx/weights.bin",
    "tokenizer.json",
    "a\u0085b",
    "\udc80",
    [],
    [0],
    [0, 0],
    [-1],
    ["x"],
    {},
    {"x": 1},
    {"prompt_lookup": "x"},
    {"draft_len": 0},
    {"prefix": "a", "suffix": "b"},
]
ELEM_TYPES = [
    TensorProto.FLOAT,
    TensorProto.FLOAT16,
    TensorProto.INT64,
    TensorProto.INT32,
    TensorProto.BOOL,
    TensorProto.STRING,
    TensorProto.DOUBLE,
]
OPS = [
    ("", "Loop"),
    ("", "If"),
    ("", "Scan"),
    ("", "Identity"),
    ("", "Add"),
    ("custom.evil", "Spin"),
    ("com.microsoft", "Attention"),
    ("", "ConstantOfShape"),
    ("ai.onnx.ml", "TreeEnsembleClassifier"),
    ("ai.adaptive_export", "MatMulPacked"),  # allowed ops, refused here: one input, no weight rows
    ("ai.adaptive_export", "GatherPacked"),
]


def paths_of(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += paths_of(value, prefix + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node[:3]):
            out += paths_of(value, prefix + (index,))
    return out


def mutate_manifest(rng: random.Random, manifest: dict[str, Any]) -> str:
    targets = [p for p in paths_of(manifest) if p]
    done = []
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(targets)
        parent: Any = manifest
        try:
            for key in path[:-1]:
                parent = parent[key]
            if rng.random() < 0.7:
                parent[path[-1]] = copy.deepcopy(rng.choice(JSON_VALUES))  # never share one object (JSON has no cycles)
                done.append(f"set {path}")
            elif isinstance(parent, dict):
                parent.pop(path[-1], None)
                done.append(f"drop {path}")
        except (KeyError, IndexError, TypeError):
            continue
    return "; ".join(done)


def mutate_graph(rng: random.Random, root: Path, manifest: dict[str, Any]) -> str:
    graph = rng.choice(sorted(manifest["graphs"]))
    path = root / manifest["backends"]["onnx"]["graphs"][graph]["file"]
    model = onnx.load(str(path), load_external_data=False)
    choice = rng.randrange(7)
    values = list(model.graph.input) + list(model.graph.output)
    value = rng.choice(values)
    if choice == 0:
        value.name = rng.choice(["tokens", "past_key_9", "logits", "new_value_0", "x\u0085"])
    elif choice == 1:
        value.type.tensor_type.elem_type = rng.choice(ELEM_TYPES)
    elif choice == 2 and len(value.type.tensor_type.shape.dim):
        dim = rng.choice(list(value.type.tensor_type.shape.dim))
        dim.dim_value = rng.choice([1, 2, 3, 7, 300, 10**9])
    elif choice == 3:
        domain, op = rng.choice(OPS)
        if domain and domain not in {o.domain for o in model.opset_import}:
            model.opset_import.append(helper.make_opsetid(domain, 1))
        model.graph.node.append(helper.make_node(op, [model.graph.input[0].name], [f"fuzz_{op}"], domain=domain))
    elif choice == 4 and len(model.graph.initializer):
        init = rng.choice(list(model.graph.initializer))
        init.data_location = TensorProto.EXTERNAL
        del init.external_data[:]
        entry = init.external_data.add()
        entry.key, entry.value = (
            "location",
            rng.choice(["weights.bin", "../tokenizer.json", "/etc/hostname", "../../x", "prefill.onnx"]),
        )
    elif choice == 5:
        del model.graph.output[rng.randrange(len(model.graph.output))]
    else:
        model.functions.append(
            helper.make_function(
                "local", "f", ["a"], ["b"], [helper.make_node("Identity", ["a"], ["b"])], [helper.make_opsetid("", 18)]
            )
        )
    path.write_bytes(model.SerializeToString())
    return f"graph {graph} mutation {choice}"


def mutate_files(rng: random.Random, root: Path, manifest: dict[str, Any]) -> str:
    files = manifest["files"]
    name = rng.choice(sorted(files))
    choice = rng.randrange(9)
    target = root / name
    if choice == 0:
        files.pop(name)
    elif choice == 1:
        files["onnx/./weights.bin" if rng.random() < 0.5 else f"./{name}"] = dict(files[name])
    elif choice == 2:
        target.unlink()
        target.mkdir()
    elif choice == 3:
        target.unlink()
        os.symlink(rng.choice(["/etc/hostname", str(root / "tokenizer.json"), "../../outside"]), target)
    elif choice == 4:
        target.unlink()
        os.mkfifo(target)
    elif choice == 5:
        target.write_bytes(target.read_bytes()[: rng.randrange(0, max(1, target.stat().st_size))])
    elif choice == 6:
        target.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 512))))
    elif choice == 7:
        os.link(target, root / "alias.bin")
        files["alias.bin"] = dict(files[name])
    else:
        (root / "extra.bin").write_bytes(b"x")
        files[rng.choice(["extra.bin", "tok\u200b.json", "a/../extra.bin"])] = {"sha256": "0" * 64, "bytes": 1}
    return f"files {name} mutation {choice}"


def exercise(root: Path) -> None:
    """What a user can do with a bundle: load it, describe it, generate from it."""
    bundle = load_bundle(root)
    render(describe(str(root)))
    generator = Generator(bundle)
    generator.generate("The sea", max_new_tokens=2, mode="auto")


@pytest.fixture(scope="module")
def base(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz") / "base"
    shutil.copytree(tiny_bundle, root)
    return root


def test_fuzzed_bundles_are_valid_or_usage_errors(base: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    outcomes = {"usage_error": 0, "valid": 0}
    baseline = rss_mb()
    for case in range(CASES):
        root = tmp_path / f"case{case}"
        shutil.copytree(base, root, symlinks=True)
        manifest = json.loads((root / "manifest.json").read_text())
        kind = rng.choices(["manifest", "graph", "files", "mixed"], weights=[4, 3, 3, 1])[0]
        described = []
        if kind in ("graph", "mixed"):
            described.append(mutate_graph(rng, root, manifest))
        if kind in ("files", "mixed"):
            described.append(mutate_files(rng, root, manifest))
        if kind in ("manifest", "mixed"):
            described.append(mutate_manifest(rng, manifest))
        if rng.random() < 0.9:  # re-signed, as an attacker would; sometimes not
            try:
                resign(root, manifest)
            except (
                OSError,
                TypeError,
                AttributeError,
                ValueError,
                KeyError,
            ):  # a mutation broke the files table itself
                (root / "manifest.json").write_text(json.dumps(manifest))
        else:
            (root / "manifest.json").write_text(json.dumps(manifest))
        started = time.monotonic()
        try:
            exercise(root)
            outcomes["valid"] += 1
        except UsageError as exc:
            assert "\n" not in exc.one_line()
            outcomes["usage_error"] += 1
        except Exception as exc:  # pragma: no cover - the failure this test exists to find
            raise AssertionError(
                f"seed {SEED} case {case} ({'; '.join(described)}): {type(exc).__name__}: {exc}"
            ) from exc
        elapsed = time.monotonic() - started
        assert elapsed < CASE_LIMIT_S, f"seed {SEED} case {case} ({'; '.join(described)}) took {elapsed:.1f} s"
        shutil.rmtree(root, ignore_errors=True)
    assert rss_mb() - baseline < RSS_GROWTH_LIMIT_MB
    assert outcomes["usage_error"] > CASES // 4 and outcomes["valid"] > 0, outcomes  # both outcomes exercised
