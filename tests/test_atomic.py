"""Saves that never tear (keras_mp/_atomic.py, keras_mp/_saves.py): a write
that fails half-way leaves the last good file, folders are swapped whole,
temporaries of killed processes go at the next save, and Keras's saving
(``model.save``, ``save_weights``, the legacy ``.h5`` writer) goes through it.

The kills themselves (SIGKILL mid-save and mid-``fit``) are in
tests/test_resume.py; that Keras itself still writes into its targets is in
tests/test_keras_changes.py.
"""

from __future__ import annotations

import os
import re
import stat

import keras
import numpy as np
import pytest

from keras_mp import _atomic
from keras_mp._atomic import atomic_path
from tests.faults import dead_pid, failing_midway, small_model


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# -- the mechanism ----------------------------------------------------------------------------

def test_a_write_failing_half_way_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("old")
    os.chmod(target, 0o640)
    with pytest.raises(OSError, match="disk full"):
        with atomic_path(target) as tmp:
            _write(tmp, "ha")
            raise OSError("disk full")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["notes.txt"]

    with atomic_path(target) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path)
        assert os.path.basename(tmp).startswith(".notes.txt.tmp-") and tmp.endswith(".txt")
        _write(tmp, "new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["notes.txt"]
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640  # the old file's permissions


@pytest.mark.parametrize("name, suffix", [("m.keras", ".keras"), ("m.weights.h5", ".weights.h5"),
                                          ("m.h5", ".h5"), ("served", ""), ("a.b.png", ".png")])
def test_the_temporary_keeps_the_suffix_keras_insists_on(tmp_path, name, suffix):
    assert _atomic.suffix_of(name) == suffix
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / name) as tmp:
            assert re.fullmatch(rf"\.{re.escape(name)}\.tmp-{os.getpid()}-[0-9a-f]{{8}}"
                                rf"{re.escape(suffix)}", os.path.basename(tmp)), tmp
            raise RuntimeError("look only")


def test_stale_temporaries_go_at_the_next_save_into_the_folder(tmp_path):
    dead, alive = dead_pid(), os.getppid()
    stale = [f".m.keras.tmp-{dead}-0123abcd.keras", f".other.png.tmp-{dead}-89abcdef.png",
             f".m.keras.tmp-{os.getpid()}-00000000.keras"]  # this process's, from no save
    kept = [f".m.keras.tmp-{alive}-0123abcd.keras",  # a save under way in another process
            f".m.keras.tmp-{dead}-0123abcd.weights.h5",  # not the suffix the name needs
            ".hidden", "m.keras.tmp-1-0123abcd.keras", "m.keras"]
    for name in stale + kept:
        _write(str(tmp_path / name), "x")
    os.mkdir(tmp_path / f".served.tmp-{dead}-0badf00d")
    with atomic_path(tmp_path / "picture.png") as tmp:
        _write(tmp, "png")
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ["picture.png"])


def test_a_folder_is_swapped_whole(tmp_path):
    target = tmp_path / "served"
    for content in ("first", "second"):
        with atomic_path(target, directory=True) as tmp:
            assert not os.path.exists(tmp)
            os.mkdir(tmp)
            _write(os.path.join(tmp, content), content)
        assert os.listdir(target) == [content]  # nothing of the folder it replaced
        assert os.listdir(tmp_path) == ["served"]
    with pytest.raises(OSError, match="killed"):
        with atomic_path(target, directory=True) as tmp:
            os.mkdir(tmp)
            _write(os.path.join(tmp, "third"), "third")
            raise OSError("killed")
    assert os.listdir(target) == ["second"] and os.listdir(tmp_path) == ["served"]


def test_a_swap_cut_between_its_two_renames_is_repaired_at_the_next_save(tmp_path):
    """Where the system cannot exchange two folders in one step, the old one is
    renamed aside first: a kill then leaves no folder at the target."""
    dead = dead_pid()
    old = tmp_path / f".served.old-{dead}-0123abcd"
    new = tmp_path / f".served.tmp-{dead}-89abcdef"
    for folder, content in ((old, "old"), (new, "new")):
        os.mkdir(folder)
        _write(str(folder / content), content)
    with atomic_path(tmp_path / "picture.png") as tmp:
        _write(tmp, "png")
    assert sorted(os.listdir(tmp_path)) == ["picture.png", "served"]
    assert os.listdir(tmp_path / "served") == ["old"]


def test_a_link_is_followed_and_bad_targets_fail_before_any_write(tmp_path):
    real = tmp_path / "real.txt"
    real.write_text("old")
    os.symlink(real, tmp_path / "link.txt")
    with atomic_path(tmp_path / "link.txt") as tmp:
        _write(tmp, "new")
    assert os.path.islink(tmp_path / "link.txt") and real.read_text() == "new"

    with pytest.raises(FileNotFoundError, match="missing"):
        with atomic_path(tmp_path / "missing" / "m.keras"):
            pass
    with pytest.raises(IsADirectoryError):
        with atomic_path(tmp_path):
            pass
    with pytest.raises(NotADirectoryError):
        with atomic_path(real, directory=True):
            pass


# -- Keras's saving goes through it --------------------------------------------------------------

def _save(model, path):
    if path.endswith(".weights.h5"):
        model.save_weights(path)
    else:
        model.save(path)


def _assert_holds(path: str, model: keras.Model) -> None:
    if path.endswith(".weights.h5"):
        other = small_model(seed=1)
        other.load_weights(path)
    else:
        other = keras.saving.load_model(path)
    for a, b in zip(model.weights, other.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("name", ["m.keras", "m.weights.h5"])
def test_a_save_failing_half_way_keeps_the_last_good_file(tmp_path, name):
    path = str(tmp_path / name)
    good = small_model()
    _save(good, path)
    with pytest.raises(OSError, match="No space left"):
        _save(failing_midway(small_model(seed=2)), path)
    _assert_holds(path, good)
    assert os.listdir(tmp_path) == [name]


def test_model_checkpoint_and_the_legacy_h5_writer_save_atomically(tmp_path):
    model = small_model()
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "e{epoch}.keras"))
    weights = keras.callbacks.ModelCheckpoint(str(tmp_path / "last.weights.h5"),
                                              save_weights_only=True)
    model.fit(np.ones((8, 3)), np.ones((8, 1)), epochs=2, verbose=0,
              callbacks=[checkpoint, weights])
    model.save(str(tmp_path / "legacy.h5"))
    assert sorted(os.listdir(tmp_path)) == ["e1.keras", "e2.keras", "last.weights.h5",
                                           "legacy.h5"]
    _assert_holds(str(tmp_path / "e2.keras"), model)
    _assert_holds(str(tmp_path / "last.weights.h5"), model)
    legacy = keras.saving.load_model(str(tmp_path / "legacy.h5"), compile=False)
    np.testing.assert_array_equal(legacy.weights[0].numpy(), model.weights[0].numpy())
