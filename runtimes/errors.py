"""The one error type users see: a problem and its fix, printed as one line, exit code 2."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input (a bundle, an argument, a file): the CLI prints it and exits 2."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix

    def one_line(self) -> str:
        return f"error: {self.problem}. Fix: {self.fix}".replace("\n", " ")
