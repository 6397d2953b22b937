"""What preflight found: the checks run, and each problem with its field and where the value was set."""

from __future__ import annotations

from alignflow.config.loading import ConfigSources


class Findings:
    """Checks run and problems found, each problem one line: `field: what (where it was set)`."""

    def __init__(self, sources: ConfigSources):
        self.sources, self.checks, self.problems = sources, 0, []
        self.notes: list[str] = []  # what was not checked, and why (e.g. a remote file's rows past a budget)

    def ok(self) -> None:
        self.checks += 1

    def fail(self, field: str, text: str, also: tuple[str, ...] = ()) -> None:
        self.checks += 1
        where = "; ".join([self.sources.of(field), *(f"{f}: {self.sources.of(f)}" for f in also)])
        self.problems.append(f"{field}: {text} ({where})")
