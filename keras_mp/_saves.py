"""Keras's saving made atomic: ``model.save``, ``save_weights``,
``ModelCheckpoint`` and ``BackupAndRestore`` never leave a torn file.

Two faults of Keras 3.15.1, fixed for the whole process
(``keras_mp/_keras_changes.py``, changes ``atomic_saves`` and
``atomic_backups``):

* **Saves write into their target.** ``saving_lib.save_model`` opens the
  ``.keras`` file with ``"wb"``, ``saving_lib.save_weights_only`` and the
  legacy ``.h5`` writer open theirs with h5py's ``"w"``: a kill mid-save
  leaves a file that no longer loads, and a ``ModelCheckpoint`` that
  overwrites one file loses its last good checkpoint. Here each writes a
  hidden temporary beside the target and renames it into place
  (:func:`keras_mp._atomic.atomic_path`). Sharded weights
  (``max_shard_size``), unzipped model folders, remote paths (``gs://``,
  ``hf://``) and file objects go to Keras unchanged.
* **A backup is two files replaced one after the other.**
  ``BackupAndRestore`` writes ``latest.weights.h5`` and then
  ``training_metadata.json`` (the epoch to resume at): a kill between them
  pairs new weights with the old epoch, and a kill inside the first leaves
  weights that no longer load (the resume fails). Here each backup is a new
  folder ``generation-NNNNNN`` in the backup folder, holding Keras's two
  files, written by Keras's own code; the pointer ``keras_mp_backup.json``,
  written last and atomically, names the folder to resume from (and, with
  ``double_checkpoint=True``, the previous one, tried when the current one
  cannot be read). Folders the pointer does not name are removed at the next
  backup or restore. At the end of training the pointer is removed first,
  so a kill during Keras's deletion of the folder leaves no half backup. A
  backup folder in Keras's own layout (written without keras-mp) still
  restores.

Decision: the fixes apply to every save in the process, whatever the policy,
not only to models trained under keras-mp's: they change no file's content
or name (only how it reaches its name), so they cannot change what a program
gets, and a run under a plain Keras policy in a process that imported
keras-mp is as exposed to a kill as any other.

Example:
    >>> import os, tempfile, keras, keras_mp
    >>> from keras_mp import _atomic
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> folder = tempfile.mkdtemp()
    >>> model.save(os.path.join(folder, "model.keras"))
    >>> os.listdir(folder), _atomic.temporaries(folder)
    (['model.keras'], [])
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import re
import shutil

from keras.src.callbacks import backup_and_restore
from keras.src.legacy.saving import legacy_h5_format
from keras.src.saving import saving_lib
from keras.src.utils import file_utils

from keras_mp._atomic import atomic_path, fsync_path

__all__ = ["POINTER", "backup_files", "install", "read_pointer"]

#: The file in a backup folder that names the generation to resume from.
POINTER = "keras_mp_backup.json"
_GENERATION = re.compile(r"^generation-\d{6}$")
_MARK = "_keras_mp_atomic"


def _local(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and not file_utils.is_remote_path(path) \
        and not os.fspath(path).startswith("hf://")


# -- model.save, save_weights, ModelCheckpoint ---------------------------------------------

def _beside(applies, **forced):
    """Wraps a Keras function ``f(model, filepath, ...)`` that writes ``filepath``:
    where ``applies(arguments)``, it writes a temporary beside it that
    :func:`atomic_path` moves into place (with ``forced`` arguments)."""
    def wrap(keras_save):
        signature = inspect.signature(keras_save)

        @functools.wraps(keras_save)
        def save(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            if not _local(arguments["filepath"]) or not applies(arguments):
                return keras_save(*args, **kwargs)
            with atomic_path(arguments["filepath"]) as tmp:
                return keras_save(**{**arguments, "filepath": tmp, **forced})
        return save
    return wrap


def _ends(arguments, suffix: str) -> bool:
    return os.fspath(arguments["filepath"]).endswith(suffix)


def _legacy_h5(arguments) -> bool:
    """Unless Keras is to ask before overwriting; makes the folder, as Keras does."""
    path = os.fspath(arguments["filepath"])
    if not arguments["overwrite"] and os.path.isfile(path):
        return False
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    return True


_SAVES = (  # (module, function, wrapper): sharded weights and folders go to Keras unchanged
    (saving_lib, "save_model", _beside(lambda a: a["zipped"] and _ends(a, ".keras"))),
    (saving_lib, "save_weights_only",
     _beside(lambda a: a["max_shard_size"] is None and _ends(a, ".weights.h5"))),
    (legacy_h5_format, "save_model_to_hdf5", _beside(_legacy_h5, overwrite=True)),
)


# -- BackupAndRestore ------------------------------------------------------------------------

def read_pointer(backup_dir: str) -> dict | None:
    """What the pointer of a keras-mp backup folder says (``generation``,
    ``current`` and ``previous`` folder names), or None without one."""
    try:
        with open(os.path.join(backup_dir, POINTER)) as f:
            pointer = json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as e:  # written atomically: only another program can tear it
        raise ValueError(f"The BackupAndRestore pointer {os.path.join(backup_dir, POINTER)!r} "
                         f"is not keras-mp's JSON ({e}); remove the backup folder to start "
                         "afresh.") from e
    if not isinstance(pointer, dict) or not isinstance(pointer.get("current"), str):
        raise ValueError(f"The BackupAndRestore pointer {os.path.join(backup_dir, POINTER)!r} "
                         f"names no generation: {pointer!r}.")
    return pointer


def backup_files(backup_dir: str) -> tuple[str, str] | None:
    """The weights and metadata files the next restore from ``backup_dir``
    reads: the current generation's, or Keras's own (None: nothing to restore)."""
    pointer = read_pointer(backup_dir)
    folder = backup_dir if pointer is None else os.path.join(backup_dir, pointer["current"])
    files = (os.path.join(folder, "latest.weights.h5"),
             os.path.join(folder, "training_metadata.json"))
    return files if os.path.exists(files[0]) or os.path.exists(files[1]) else None


@contextlib.contextmanager
def _inside(callback, folder: str):
    """Keras's own backup code, reading and writing ``folder``'s files."""
    saved = (callback._weights_path, callback._training_metadata_path,
             callback.double_checkpoint)
    callback._weights_path = os.path.join(folder, "latest.weights.h5")
    callback._training_metadata_path = os.path.join(folder, "training_metadata.json")
    callback.double_checkpoint = False  # the generations keep the previous backup
    try:
        yield
    finally:
        (callback._weights_path, callback._training_metadata_path,
         callback.double_checkpoint) = saved


def _remove_unnamed(backup_dir: str, pointer: dict | None) -> None:
    keep = set() if pointer is None else {pointer["current"], pointer.get("previous")}
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(backup_dir):
            if _GENERATION.match(name) and name not in keep:
                shutil.rmtree(os.path.join(backup_dir, name), ignore_errors=True)


def _backup(keras_save):
    @functools.wraps(keras_save)
    def _save_model(self):
        if not _local(self.backup_dir):
            return keras_save(self)
        os.makedirs(self.backup_dir, exist_ok=True)
        pointer = read_pointer(self.backup_dir)
        generation = (pointer or {}).get("generation", 0) + 1
        name = f"generation-{generation:06d}"
        folder = os.path.join(self.backup_dir, name)
        shutil.rmtree(folder, ignore_errors=True)  # one a killed run began, named nowhere
        os.mkdir(folder)
        with _inside(self, folder):
            keras_save(self)
        fsync_path(os.path.join(folder, "training_metadata.json"))
        fsync_path(folder)
        previous = pointer["current"] if pointer and self.double_checkpoint else None
        new = {"generation": generation, "current": name, "previous": previous}
        with atomic_path(os.path.join(self.backup_dir, POINTER)) as tmp:
            with open(tmp, "w") as f:
                json.dump(new, f)
        _remove_unnamed(self.backup_dir, new)
    return _save_model


def _restore(keras_load):
    @functools.wraps(keras_load)
    def _load_model(self):
        if not _local(self.backup_dir):
            return keras_load(self)
        pointer = read_pointer(self.backup_dir)
        _remove_unnamed(self.backup_dir, pointer)
        if pointer is None:
            return keras_load(self)  # Keras's own layout, or no backup
        names = [pointer["current"]] + ([pointer["previous"]] if pointer.get("previous") else [])
        for k, name in enumerate(names):
            try:
                with _inside(self, os.path.join(self.backup_dir, name)):
                    return keras_load(self)
            except OSError:
                if k + 1 == len(names):
                    raise
    return _load_model


def _end(keras_on_train_end):
    @functools.wraps(keras_on_train_end)
    def on_train_end(self, logs=None):
        if self.delete_checkpoint and _local(self.backup_dir):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.backup_dir, POINTER))  # no backup from here on
                fsync_path(self.backup_dir)
        return keras_on_train_end(self, logs)
    return on_train_end


def _wrap(owner, attribute: str, make) -> None:
    current = getattr(owner, attribute)
    if not getattr(current, _MARK, False):
        wrapped = make(current)
        setattr(wrapped, _MARK, True)
        setattr(owner, attribute, wrapped)


def install(what: str) -> None:
    """Installs ``"saves"`` (model.save, save_weights, the legacy .h5 writer)
    or ``"backups"`` (BackupAndRestore's generations); idempotent. Keras's own
    functions stay reachable as each wrapper's ``__wrapped__``."""
    if what == "saves":
        for module, name, wrapper in _SAVES:
            _wrap(module, name, wrapper)
    elif what == "backups":
        cls = backup_and_restore.BackupAndRestore
        _wrap(cls, "_save_model", _backup)
        _wrap(cls, "_load_model", _restore)
        _wrap(cls, "on_train_end", _end)
    else:
        raise ValueError(f"`what` must be 'saves' or 'backups', got {what!r}.")
