"""The source trees a benchmark compares side by side: a copy of the working tree, and a commit.

    with compared_trees("HEAD~3") as trees:   [("HEAD~3", worktree), ("this tree", copy)]

Both live in temporary directories removed on exit; each variant's process imports its tree
through PYTHONPATH.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def snapshot() -> Path:
    """The working tree's source files (tracked and untracked, not ignored) copied to a temporary directory."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"], check=True,
                           capture_output=True, text=True).stdout.split()
    out = Path(tempfile.mkdtemp(prefix="alignflow-tree-"))
    for f in files:
        if (REPO / f).is_file():
            (out / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, out / f)
    return out


@contextlib.contextmanager
def compared_trees(against: str | None) -> Iterator[list[tuple[str, Path]]]:
    """[(label, source tree)]: a copy of this tree (it may be edited while a bench runs), after
    `against` checked out in a temporary git worktree when given (both removed on exit)."""
    copy, tree = snapshot(), Path(tempfile.mkdtemp(prefix="alignflow-against-")) if against else None
    try:
        if tree is None:
            yield [("this tree", copy)]
            return
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), against], check=True,
                       capture_output=True)
        yield [(against, tree), ("this tree", copy)]
    finally:
        shutil.rmtree(copy, ignore_errors=True)
        if tree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
