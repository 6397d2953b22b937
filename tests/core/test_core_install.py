"""install.sh, the README's first command: what it says before it installs anything."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_install_names_the_python_it_needs_before_downloading(tmp_path):
    """pip refuses the package on a Python outside requires-python, after minutes of downloads; install.sh says
    so first, with the fix (PYTHON=...), and creates nothing."""
    for name in ("install.sh", "pyproject.toml", "constraints.txt"):
        shutil.copy(REPO / name, tmp_path / name)
    fake = tmp_path / "python3.13"
    fake.write_text('#!/bin/sh\ncase "$2" in *platform*) echo 3.13.1;; *) exit 1;; esac\n')
    fake.chmod(0o755)
    out = subprocess.run(["bash", "install.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake)})
    assert out.returncode == 1
    assert out.stderr.strip() == (f"install.sh: {fake} is Python 3.13.1; alignflow needs 3.10-3.12: "
                                  "PYTHON=python3.11 ./install.sh")
    assert not (tmp_path / ".venv").exists()
    assert 'requires-python = ">=3.10,<3.13"' in (REPO / "pyproject.toml").read_text()  # what the check mirrors
