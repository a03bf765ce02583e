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
