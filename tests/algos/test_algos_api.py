"""Public API: exports resolve and every public function documents its math."""

import inspect

import pytest

import algos
from algos.advantages.estimators import ADVANTAGE_ESTIMATORS

# registry plumbing: no formula / paper to cite
NOT_MATH = {"get_advantage_estimator", "register_advantage_estimator"}


def _public_functions():
    out = []
    for name in algos.__all__:
        obj = getattr(algos, name)
        if inspect.isfunction(obj) and name not in NOT_MATH:
            out.append((name, obj))
    out += [(f"estimator:{n}", fn) for n, fn in ADVANTAGE_ESTIMATORS.items()]
    return out


def test_all_exports_resolve():
    for name in algos.__all__:
        assert hasattr(algos, name), name


@pytest.mark.parametrize("name,fn", _public_functions(),
                         ids=[n for n, _ in _public_functions()])
def test_docstring_has_formula_shapes_and_paper(name, fn):
    doc = inspect.getdoc(fn) or ""
    assert "formula" in doc.lower(), f"{name}: no formula"
    assert "shapes" in doc.lower(), f"{name}: no tensor shapes"
    assert "arxiv" in doc.lower(), f"{name}: no paper reference"


def test_registry_helpers_documented():
    for name in NOT_MATH:
        assert inspect.getdoc(getattr(algos, name))
