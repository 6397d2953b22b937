"""algos/ must stay pure torch + stdlib: no engine/orchestration/tracking imports."""

import ast
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
ALGOS = REPO / "algos"
FORBIDDEN = {"ray", "vllm", "deepspeed", "prefect", "prefect_ray", "mlflow"}
# also off-limits for this layer: other heavy libs and the rest of the repo
ALSO_FORBIDDEN = {"transformers", "pydantic", "flows", "tasks", "engines", "alignflow"}
ALLOWED = {"torch", "math", "dataclasses", "typing", "types", "__future__"}


def _module_files():
    files = sorted(ALGOS.rglob("*.py"))
    assert files, "no modules found under algos/"
    return files


def _module_name(path):
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _absolute_imports(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0], node.lineno


def test_no_forbidden_imports_in_source():
    bad = [f"{p.relative_to(REPO)}:{line}: import {name}"
           for p in _module_files() for name, line in _absolute_imports(p)
           if name in FORBIDDEN | ALSO_FORBIDDEN]
    assert not bad, "forbidden imports in algos/:\n" + "\n".join(bad)


def test_only_torch_and_stdlib_allowlist():
    bad = [f"{p.relative_to(REPO)}:{line}: import {name}"
           for p in _module_files() for name, line in _absolute_imports(p)
           if name not in ALLOWED]
    assert not bad, "algos/ may import only " + ", ".join(sorted(ALLOWED)) + ":\n" + "\n".join(bad)


def test_importing_every_module_loads_no_forbidden_package():
    modules = [_module_name(p) for p in _module_files()]
    code = (
        "import importlib, json, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        f"forbidden = {sorted(FORBIDDEN | ALSO_FORBIDDEN)!r}\n"
        "report = {}\n"
        f"for mod in {modules!r}:\n"
        "    importlib.import_module(mod)\n"
        "    report[mod] = [n for n in forbidden\n"
        "                   if any(k == n or k.startswith(n + '.') for k in sys.modules)]\n"
        "print(json.dumps(report))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == set(modules)
    leaked = {mod: names for mod, names in report.items() if names}
    assert not leaked, f"importing algos modules loaded forbidden packages: {leaked}"
