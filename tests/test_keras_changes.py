"""What importing keras-mp changes in Keras (keras_mp/_keras_changes.py): every
change installed from one place, every Keras attribute it wraps still there, and
each fault a fix is for still in the installed Keras (when a Keras release fixes
one, its test here fails: the fix can go)."""

from __future__ import annotations

import gc
import inspect
import re
from pathlib import Path

import keras
import numpy as np
import pytest
from keras.dtype_policies import DTypePolicyMap

import keras_mp
from keras_mp import _keras_changes, distribute
from tests.faults import CutAfterWeights, failing_midway, small_model

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


def _weights_equal(a: keras.Model, b: keras.Model) -> bool:
    return all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a.weights, b.weights))


def test_keras_still_writes_a_save_into_its_target(tmp_path):
    """Keras's own save functions (what `atomic_saves` wraps): a save failing half-way has
    already replaced the last good file (a kill there leaves it torn)."""
    from keras.src.saving import saving_lib

    keras_path = str(tmp_path / "m.keras")
    weights_path = str(tmp_path / "m.weights.h5")
    good = small_model()
    good.save(keras_path)
    good.save_weights(weights_path)
    bad = failing_midway(small_model(seed=2))
    for keras_save, path in ((saving_lib.save_model.__wrapped__, keras_path),
                             (saving_lib.save_weights_only.__wrapped__, weights_path)):
        with pytest.raises(OSError, match="No space left"):
            keras_save(bad, path)
    gc.collect()  # h5py closes (and flushes) the file Keras left open
    with pytest.raises(ValueError, match="model.weights.h5"):
        keras.saving.load_model(keras_path)  # the old model is gone
    other = small_model(seed=3)
    other.load_weights(weights_path)
    assert not _weights_equal(other, good)  # the failed save's weights, not the good ones

    # With the fix: the last good files.
    good.save(keras_path)
    good.save_weights(weights_path)
    for save, path in ((bad.save, keras_path), (bad.save_weights, weights_path)):
        with pytest.raises(OSError, match="No space left"):
            save(path)
    assert _weights_equal(keras.saving.load_model(keras_path), good)
    other.load_weights(weights_path)
    assert _weights_equal(other, good)


def test_keras_backup_still_replaces_its_weights_then_its_metadata(tmp_path):
    """Keras's own BackupAndRestore code (what `atomic_backups` wraps): cut between its
    two files, a restore pairs the new weights with the old epoch (the epoch is trained
    twice, from weights that already saw it)."""
    from keras.callbacks import BackupAndRestore

    keras_save = BackupAndRestore._save_model.__wrapped__
    keras_load = BackupAndRestore._load_model.__wrapped__
    for who, save, load in (("keras", keras_save, keras_load),
                            ("keras_mp", BackupAndRestore._save_model,
                             BackupAndRestore._load_model)):
        folder = str(tmp_path / who)
        model = small_model(cls=CutAfterWeights)
        backup = BackupAndRestore(folder)
        backup.set_model(model)
        backup._current_epoch = 1
        save(backup)
        at_epoch_1 = [w.numpy().copy() for w in model.weights]
        model.fit(np.ones((8, 3)), np.ones((8, 1)), verbose=0)  # epoch 2
        backup._current_epoch, model.cut = 2, True
        with pytest.raises(OSError, match="killed after the weights"):
            save(backup)

        fresh = small_model(seed=1, cls=CutAfterWeights)
        restore = BackupAndRestore(folder)
        restore.set_model(fresh)
        load(restore)
        assert fresh._initial_epoch == 1
        same = all(np.array_equal(a, w.numpy()) for a, w in zip(at_epoch_1, fresh.weights))
        assert same == (who == "keras_mp"), who  # Keras: the new weights with the old epoch


def test_the_wrapped_save_functions_take_the_arguments_atomic_saves_reads():
    """`atomic_saves` reads these by name; a Keras release that renames one fails here."""
    from keras.src.legacy.saving import legacy_h5_format
    from keras.src.saving import saving_lib

    for function, names in ((saving_lib.save_model, ["model", "filepath", "weights_format",
                                                     "zipped"]),
                            (saving_lib.save_weights_only, ["model", "filepath",
                                                            "max_shard_size", "objects_to_skip"]),
                            (legacy_h5_format.save_model_to_hdf5,
                             ["model", "filepath", "overwrite", "include_optimizer"])):
        assert list(inspect.signature(function.__wrapped__).parameters) == names, function
    from keras.callbacks import BackupAndRestore

    backup = BackupAndRestore("unused")  # the attributes atomic_backups redirects
    assert {"_weights_path", "_training_metadata_path", "double_checkpoint",
            "delete_checkpoint", "backup_dir"} <= set(vars(backup))


def test_keras_still_has_the_remat_fault():
    """Keras's TensorFlow ``remat`` still fails on a keyword argument in graph
    mode (tests/execution/test_remat.py shows keras-mp's doing what it cannot)."""
    from keras.src.backend.tensorflow import core

    from keras_mp.execution import remat

    from keras.src.ops.operation import Operation

    assert core.remat is remat.remat  # installed
    assert Operation.rematerialized_call.__wrapped__ is remat._state["keras_rematerialized_call"]
    assert remat.keras_has_fault(), (
        "Keras's remat no longer fails on keyword arguments: check the other faults of "
        "keras_mp/execution/remat.py and remove the change where Keras has fixed them.")
