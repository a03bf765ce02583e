"""Property tests: manifests, runtime arguments and token inputs only ever produce the
documented errors (UsageError), never a crash or a hang."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adaptive_export.runtimes import Generator, SamplingParams, UsageError
from adaptive_export.runtimes.manifest import validate
from tests.test_fuzz_bundles import exercise, paths_of

JSON_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True), st.text(max_size=8)
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)
FUZZ = settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.fixture(scope="module")
def manifest(tiny_bundle: Path) -> dict[str, Any]:
    return json.loads((tiny_bundle / "manifest.json").read_text())


@pytest.fixture(scope="module")
def fuzz_root(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("manifest-fuzz") / "bundle"
    shutil.copytree(tiny_bundle, root)
    return root


@FUZZ
@given(data=st.data())
def test_mutated_manifests_are_valid_or_usage_errors(
    manifest: dict[str, Any], fuzz_root: Path, data: st.DataObject
) -> None:
    """A manifest that validates is also loaded and run (a valid-looking manifest the runtime
    then trips over, e.g. speculation {"prompt_lookup": "x"} under --mode auto, fails here)."""
    mutated = copy.deepcopy(manifest)
    targets = [p for p in paths_of(mutated) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(targets))
        parent = mutated
        try:
            for key in path[:-1]:
                parent = parent[key]
            if data.draw(st.booleans()):
                parent[path[-1]] = data.draw(JSON_VALUES)
            elif isinstance(parent, dict):
                parent.pop(path[-1], None)
        except (KeyError, IndexError, TypeError):
            continue
    try:
        validate(mutated)
    except UsageError as exc:
        assert "\n" not in exc.one_line()
        return
    (fuzz_root / "manifest.json").write_text(json.dumps(mutated))
    try:
        exercise(fuzz_root)
    except UsageError as exc:
        assert "\n" not in exc.one_line()


@pytest.fixture(scope="module")
def generator(tiny_bundle: Path) -> Generator:
    return Generator(tiny_bundle)


@FUZZ
@given(
    temperature=st.one_of(st.floats(-2, 3), st.just(float("nan")), st.just(float("inf"))),
    top_p=st.one_of(st.floats(-0.5, 1.5), st.just(float("nan"))),
    top_k=st.integers(-3, 400),
    max_new=st.integers(-3, 140),
    seed=st.integers(0, 2**32 - 1),
)
def test_runtime_arguments_generate_or_raise_usage_error(
    generator: Generator, temperature: float, top_p: float, top_k: int, max_new: int, seed: int
) -> None:
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        result = generator.generate("The sea", max_new_tokens=max_new, sampling=params, raw=True)
    except UsageError:
        return
    assert 1 <= len(result.tokens) <= max_new
    assert all(0 <= t < generator.bundle.model.vocab_size for t in result.tokens)


@FUZZ
@given(ids=st.lists(st.integers(-10, 400), min_size=0, max_size=130), max_new=st.integers(1, 8))
def test_token_inputs_generate_or_raise_usage_error(generator: Generator, ids: list[int], max_new: int) -> None:
    try:
        result = generator.generate(ids, max_new_tokens=max_new)
    except UsageError:
        vocab = generator.bundle.model.vocab_size
        assert not ids or any(t < 0 or t >= vocab for t in ids) or len(ids) + max_new > generator.bundle.max_len
        return
    assert 1 <= len(result.tokens) <= max_new
