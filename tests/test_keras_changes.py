"""What importing keras-mp changes in Keras (keras_mp/_keras_changes.py): every
change installed from one place, every Keras attribute it wraps still there, and
each fault a fix is for still in the installed Keras (when a Keras release fixes
one, its test here fails: the fix can go)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import keras
import numpy as np
import pytest
from keras.dtype_policies import DTypePolicyMap

import keras_mp
from keras_mp import _keras_changes, distribute

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "keras_mp")
ALL = _keras_changes.ON_IMPORT + _keras_changes.PER_INSTANCE


def test_every_change_on_import_is_installed_in_order():
    assert _keras_changes.installed() == tuple(c.name for c in _keras_changes.ON_IMPORT)
    assert _keras_changes.install() == _keras_changes.installed()  # idempotent


def test_changes_are_installed_from_one_module_only():
    """No module but _keras_changes calls an install function on import."""
    calls = re.compile(r"^(?!_keras_changes\.)(?:patch_multi_worker|\w+\.install|"
                       r"\w+\.patch_\w+|install)\(", re.M)
    found = [str(p.relative_to(ROOT)) for p in (ROOT / "keras_mp").rglob("*.py")
             if p.name != "_keras_changes.py" and calls.search(p.read_text())]
    assert not found, f"modules that change Keras on import themselves: {found}"


@pytest.mark.parametrize("change", ALL, ids=lambda c: c.name)
def test_every_change_is_described(change):
    assert change.kind in ("fault", "feature", "instance")
    assert change.reason and "\n" not in change.reason
    assert change.keras and change.targets
    assert (change.install is None) == (change.kind == "instance")
    assert (ROOT / (change.module.replace(".", "/") + ".py")).exists() or \
        (ROOT / change.module.replace(".", "/") / "__init__.py").exists()


@pytest.mark.parametrize("target", sorted({t for c in ALL for t in c.targets}))
def test_every_keras_attribute_wrapped_still_exists(target):
    assert _keras_changes.resolve(target) is not None


@pytest.mark.parametrize("target", sorted({t for c in _keras_changes.ON_IMPORT
                                           if c.kind == "feature" for t in c.targets}))
def test_feature_targets_run_keras_mp_code(target):
    """What the feature changes replaced is keras-mp's code now."""
    fn = _keras_changes.resolve(target)
    assert inspect.getsourcefile(fn).startswith(PACKAGE), target


def test_the_docs_list_every_change():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## What importing keras-mp changes in Keras", 1)[1].split("\n## ", 1)[0]
    for change in ALL:
        assert f"`{change.name}`" in section, change.name


# -- the faults the fixes are for: each fails once Keras no longer has it ---------------

def test_keras_still_has_the_multi_worker_faults():
    """Both faults are in the installed Keras's source (tests/test_multi_worker.py shows
    fit failing without the fix exactly where they are found)."""
    assert distribute.keras_multi_worker_faults() == distribute.FAULTS, (
        "Keras no longer has a multi-worker fault: remove its fix (keras_mp.distribute, "
        "keras_mp/_keras_changes.py).")


def test_keras_still_cannot_quantize_a_layer_holding_a_policy_map():
    """Keras's own DTypePolicyMap, no keras-mp policy: Keras reads the map's name."""
    layer = keras.layers.Dense(4, dtype=DTypePolicyMap(default_policy="mixed_bfloat16"))
    layer.build((None, 3))
    with pytest.raises(ValueError, match="Cannot convert 'map_mixed_bfloat16'"):
        layer.quantize("int8")


def test_the_quantize_fix_lets_an_adaptive_layer_quantize():
    with keras_mp.policy_scope("adaptive_bfloat16"):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    model.quantize("int8")
    assert model.layers[0].dtype_policy.name == "int8_from_mixed_bfloat16"
    assert model.predict(np.ones((1, 3), "float32"), verbose=0).shape == (1, 4)
