"""In CI a skip fails unless its reason is one CI accepts (tests/conftest.py, issue #39): a missing
extra or model package must not quietly turn tests into skips."""

from __future__ import annotations

import pytest

from tests.conftest import CI_ACCEPTED_SKIPS, fail_skip, unaccepted_skip


def skipped(reason: str) -> pytest.TestReport:
    return pytest.TestReport("t.py::t", ("t.py", 1, "t"), {}, "skipped", ("t.py", 1, f"Skipped: {reason}"), "call")


@pytest.mark.parametrize("ci", ["true", ""])
def test_a_missing_extra_fails_in_ci_only(monkeypatch: pytest.MonkeyPatch, ci: str) -> None:
    monkeypatch.setenv("CI", ci)
    report = skipped("could not import 'coremltools': No module named 'coremltools'")
    assert unaccepted_skip(report) == (ci == "true")
    if ci:
        fail_skip(report)
        assert report.failed and "skipped in CI" in str(report.longrepr)


@pytest.mark.parametrize("accepted", CI_ACCEPTED_SKIPS)
def test_what_the_machine_cannot_have_stays_a_skip(monkeypatch: pytest.MonkeyPatch, accepted: str) -> None:
    monkeypatch.setenv("CI", "true")
    assert not unaccepted_skip(skipped(f"because {accepted} here"))


def literal_skip_reasons() -> list[tuple[str, str]]:
    """(file:line, reason) of every skip in tests/ whose reason is written out: `pytest.skip("...")`,
    `skipif(..., reason="...")` and `importorskip(..., reason="...")` (f-strings: their literal parts)."""
    import ast
    from pathlib import Path

    found = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            if node.func.attr not in {"skip", "skipif", "importorskip"}:
                continue
            texts = [k.value for k in node.keywords if k.arg == "reason"]
            texts += node.args[:1] if node.func.attr == "skip" else []
            for text in texts:
                if isinstance(text, ast.Constant) and isinstance(text.value, str):
                    found.append((f"{path.name}:{node.lineno}", text.value))
                elif isinstance(text, ast.JoinedStr):
                    literal = "".join(v.value for v in text.values if isinstance(v, ast.Constant))
                    found.append((f"{path.name}:{node.lineno}", literal))
    return found


def test_every_written_skip_is_accepted_in_ci_or_names_an_install() -> None:
    """A skip CI would turn into a failure is one for something `.ci/run` installs (its reason names the
    `pip install`); any other reason must be one CI accepts, found here rather than by a red CI run."""
    reasons = literal_skip_reasons()
    assert len(reasons) >= 10, reasons  # the scan found the suite's skips
    unaccepted = [
        (where, reason)
        for where, reason in reasons
        if "pip install" not in reason and not any(accepted in reason for accepted in CI_ACCEPTED_SKIPS)
    ]
    assert unaccepted == []
