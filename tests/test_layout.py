"""The package's shape (docs/architecture.md): subpackages by concept, imports
that only run down the floors, no import circle, no module past ~500 lines,
and the public names of earlier releases still where users found them.

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
    {"_backend", "_checks", "_cloning", "_gradients", "_installed", "_lazy", "_version", "data",
     "datasets", "distribute"},
    {"device"},
    {"scaling", "fused"},
    {"execution"},
    {"adaptive"},
    {"policies", "callbacks", "deploy"},
    {"cli", "tuning", "benchmarks"},
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


def _floor(name: str) -> int:
    if name == "keras_mp":
        return len(FLOORS)
    top = name.split(".")[1]
    for i, floor in enumerate(FLOORS):
        if top in floor:
            return i
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


# Names of keras_mp.__all__ before the package was split into subpackages
# (0.1.0): each still resolves, the modules to the module now holding them.
EARLIER_ALL = {
    "AdaptivePolicy": None, "DynamicLossScale": None, "FixedLossScale": None,
    "LossScaleOptimizer": None, "LossScaleSchedule": None, "PiecewiseInterval": None,
    "autofit": "keras_mp.adaptive.autofit", "callbacks": "keras_mp.callbacks",
    "controller": "keras_mp.adaptive.controller", "device": "keras_mp.device",
    "distribute": "keras_mp.distribute", "execution": "keras_mp.execution",
    "export": "keras_mp.deploy.export", "forward": "keras_mp.adaptive.forward", "fuse": None,
    "fused_update": "keras_mp.execution.fused_update", "global_policy": None,
    "hooks": "keras_mp.adaptive.hooks", "kernels": "keras_mp.scaling.kernels",
    "layers": "keras_mp.fused.layers", "loss_scale": "keras_mp.scaling.loss_scale",
    "ops": "keras_mp.fused.ops", "patch_multi_worker": None, "policies": "keras_mp.policies",
    "policy_scope": None, "precision_report": None,
    "precision_state": "keras_mp.adaptive.state", "probe": "keras_mp.adaptive.probe",
    "quantization": "keras_mp.deploy.quantization", "quantize": None,
    "report": "keras_mp.adaptive.report", "set_global_policy": None, "set_xla": None,
    "stats": "keras_mp.adaptive.stats", "uses_xla": None, "xla": "keras_mp.device.xla",
}


@pytest.mark.parametrize("name", sorted(EARLIER_ALL))
def test_names_of_earlier_releases_still_resolve(name):
    assert name in keras_mp.__all__
    obj = getattr(keras_mp, name)
    module = EARLIER_ALL[name]
    if module is not None:
        assert obj is importlib.import_module(module)


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
])
def test_documented_import_paths(path, attribute):
    """``from <path> import <attribute>``, as the docs show it, works."""
    assert hasattr(importlib.import_module(path), attribute)
