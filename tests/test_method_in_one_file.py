"""A method is one file: the registry, `quantwm methods`, the budget rule and the frontier's sweep read what its class
declares (quantwm/core/methods/__init__.py imports every module of the package)."""
import importlib.util
import pathlib
import pkgutil
import sys

import pytest

import quantwm.core.methods as methods
from quantwm.cli import main
from quantwm.core import budget
from quantwm.core.methods import REGISTRY
from quantwm.core.methods.base import Method, register
from quantwm.drivers.frontier import make_tasks, sweep_grid

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = "onefile-rtn"


@pytest.fixture
def one_file_method():
    spec = importlib.util.spec_from_file_location("one_file_method", ROOT / "tests" / "data" / "one_file_method.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers it, as the package's import of every module would
    yield module.OneFileRTN
    REGISTRY.pop(NAME, None)


def test_methods_package_imports_every_module():
    found = {m.name for m in pkgutil.iter_modules(methods.__path__)}
    assert {"oscar", "turboquant", "span_rtn"} <= found
    assert all(f"quantwm.core.methods.{name}" in sys.modules for name in found)


def test_method_in_one_file_is_listed_fitted_and_swept(one_file_method, capsys):
    assert main(["methods"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if f" {NAME} " in line)
    assert one_file_method.source in row
    opts, bits = budget.configure(NAME, 3.5, 64, 128, "k")
    assert opts == {"bits": 3} and bits <= 3.5
    with pytest.raises(ValueError, match="cannot fit"):
        budget.configure(NAME, 2.5, 64, 128, "k")  # its rule, not span-rtn's, which would fit 2 bits
    assert sweep_grid()[NAME] == [{}, {"values": "channels"}]
    tasks = make_tasks(["trace:x"], {NAME: sweep_grid()[NAME]}, [2, 3], "k")
    assert [(t["options"], t["bits"]) for t in tasks] == [({}, 2), ({}, 3), ({"values": "channels"}, 2),
                                                          ({"values": "channels"}, 3)]


def test_nothing_in_the_package_names_the_one_file_method():
    named = [p for p in (ROOT / "quantwm").rglob("*.py") if NAME in p.read_text() or "one_file_method" in p.read_text()]
    assert not named


def test_method_without_a_budget_rule_says_so():
    @register("norule-test")
    class NoRule(Method):
        name = "norule-test"

    try:
        with pytest.raises(ValueError, match="no budget rule for method 'norule-test'"):
            budget.candidates("norule-test", 64)
        assert "norule-test" not in sweep_grid()  # declares no sweep: not swept
    finally:
        REGISTRY.pop("norule-test")


def test_sweep_is_the_class_own_not_inherited():
    assert "qvg-pro" not in sweep_grid() and "quantwm-qsac" not in sweep_grid()  # their parents' sweeps do not leak
    assert sweep_grid(quick=True) == {"quantwm": [{"budget": 2.5}], "qvg": [{"n_centroids": 6}], "rtn": [{}]}
