"""The package's shape (docs/architecture.md): subpackages by concept, imports
that only run down the floors (the package's, and inside ``keras_mp.adaptive``
its subpackages'), no import circle, no module past ~500 lines, and the
public face: ``keras_mp.__all__`` and ``dir(keras_mp)`` exactly the pinned list.

The import graph is read from the source (every ``import`` statement,
function-level ones included), so a late import cannot hide a circle.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import keras_mp

ROOT = Path(__file__).resolve().parents[1] / "keras_mp"

#: Floors, lowest first: a module may import its own package and any lower
#: floor, never a higher one. (``keras_mp`` itself, the public API, is the top.)
FLOORS: list[set[str]] = [
    {"_atomic", "_backend", "_checks", "_cloning", "_gradients", "_installed", "_lazy", "_saves",
     "_version", "data", "datasets", "distribute"},
    {"device"},
    {"scaling", "fused"},
    {"execution"},
    {"adaptive"},
    {"policies", "callbacks", "config", "deploy"},
    {"cli", "tuning", "benchmarks"},
    {"_keras_changes"},   # installs every change to Keras: above all it installs
]
#: Floors inside ``keras_mp.adaptive`` (its own ``__init__`` is above them all).
ADAPTIVE_FLOORS: list[set[str]] = [
    {"decisions"},
    {"policy"},
    {"record"},
    {"evidence"},
    {"storage"},
    {"integration"},
    {"outputs"},
    {"fit"},
]
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The keras_mp modules ``name`` imports (the module, or for ``from
    package import name`` the submodule where ``name`` is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target.startswith("keras_mp.benchmarks"):
                continue  # the repository's benchmarks/, installed beside the package
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _floor(name: str) -> tuple[int, int]:
    """(floor, floor inside ``keras_mp.adaptive``): compared as a pair."""
    if name == "keras_mp":
        return (len(FLOORS), 0)
    parts = name.split(".")
    for i, floor in enumerate(FLOORS):
        if parts[1] in floor:
            if parts[1] != "adaptive":
                return (i, 0)
            if len(parts) == 2:
                return (i, len(ADAPTIVE_FLOORS))
            for j, inner in enumerate(ADAPTIVE_FLOORS):
                if parts[2] in inner:
                    return (i, j)
            raise AssertionError(f"{name}: not on any floor of ADAPTIVE_FLOORS; place it there")
    raise AssertionError(f"{name}: not on any floor of FLOORS; place it there")


def test_every_module_is_on_a_floor():
    for name in _modules():
        _floor(name)


def test_imports_only_run_down():
    up = [(a, b) for a, targets in _graph().items() for b in targets
          if b != "keras_mp" and _floor(b) > _floor(a)]
    to_root = [(a, b) for a, targets in _graph().items() for b in targets
               if b == "keras_mp" and a != "keras_mp"]
    assert not up, f"imports that run up a floor: {sorted(up)}"
    assert not to_root, f"modules that import the public API back: {sorted(to_root)}"


def test_no_import_circle():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("name", sorted(_modules()))
def test_no_module_past_the_length_limit(name):
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name}: {lines} lines; split it by concept"


def test_every_package_is_installed():
    """A plain ``pip install .`` ships every package (pyproject lists them)."""
    import tomllib

    config = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    packages = {_module_name(p.parent / "__init__.py") for p in ROOT.rglob("__init__.py")}
    assert packages <= listed, f"packages missing from pyproject.toml: {sorted(packages - listed)}"


#: keras_mp's public face, exactly: what a user calls, and the subpackages.
PUBLIC = [
    "AdaptivePolicy", "DynamicLossScale", "FixedLossScale", "LossScaleOptimizer",
    "LossScaleSchedule", "PiecewiseInterval", "adaptive", "callbacks", "config", "deploy",
    "device", "distribute", "execution", "export", "fuse", "fused", "global_policy",
    "plot_precision", "policies", "policy_scope", "precision_report", "quantize", "scaling",
    "set_global_policy",
]


def test_public_names_are_the_pinned_list():
    assert sorted(keras_mp.__all__) == PUBLIC
    assert [n for n in dir(keras_mp) if not n.startswith("_")] == PUBLIC
    for name in PUBLIC:
        assert getattr(keras_mp, name) is not None


def test_dir_stays_pinned_after_submodules_are_imported():
    import keras_mp.cli  # noqa: F401  (submodules a user may import on their own)
    import keras_mp.data  # noqa: F401

    assert [n for n in dir(keras_mp) if not n.startswith("_")] == PUBLIC


@pytest.mark.parametrize("name", ["export", "precision_report", "plot_precision", "fuse",
                                  "quantize"])
def test_public_functions_are_functions(name):
    """The names a user calls are the functions, not modules of the same name."""
    assert callable(getattr(keras_mp, name))


@pytest.mark.parametrize("name", ["autofit", "controller", "forward", "fused_update", "hooks",
                                  "kernels", "layers", "loss_scale", "ops", "patch_multi_worker",
                                  "precision_state", "probe", "quantization", "report",
                                  "set_xla", "stats", "uses_xla", "xla"])
def test_module_aliases_are_gone(name):
    """Nothing was released under these names; each lives in its subpackage."""
    assert name not in keras_mp.__all__
    with pytest.raises(AttributeError):
        getattr(keras_mp, name)


def test_subpackages_say_what_they_hold():
    """Every package of keras_mp.adaptive opens with a docstring, its first line a summary."""
    for init in (ROOT / "adaptive").glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and doc.splitlines()[0].strip(), f"{init}: no docstring"


@pytest.mark.parametrize("path, attribute", [
    ("keras_mp.callbacks", "AdaptivePrecision"),
    ("keras_mp.policies", "policy_of"),
    ("keras_mp.policies", "adaptive_layers"),
    ("keras_mp.policies", "AdaptivePolicy"),
    ("keras_mp.execution", "configure"),
    ("keras_mp.execution", "chosen"),
    ("keras_mp.execution", "profile"),
    ("keras_mp.device", "default_candidates"),
    ("keras_mp.device", "profile"),
    ("keras_mp.distribute", "patch_multi_worker"),
    ("keras_mp.adaptive", "DecisionRule"),
    ("keras_mp.config", "set_autofit"),
    ("keras_mp.config", "set_min_saving"),
    ("keras_mp.config", "set_xla"),
    ("keras_mp.config", "uses_xla"),
    ("keras_mp.config", "set_execution"),
])
def test_documented_import_paths(path, attribute):
    """``from <path> import <attribute>``, as the docs show it, works."""
    assert hasattr(importlib.import_module(path), attribute)
