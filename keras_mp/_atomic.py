"""Files and folders replaced whole or not at all: :func:`atomic_path`.

Why: Keras's ``model.save`` opens its target with ``"wb"`` and
``save_weights`` with h5py's ``"w"``: both empty the file first and then
write into it. A process killed mid-save (SIGKILL, the out-of-memory killer,
a preempted machine) or an error half-way leaves a torn file where the last
good one was (issue 46: 12 kills of 12). Here the new content is written
under a hidden temporary name beside the target and moved into place with
``os.replace``, one atomic rename: at every moment the target is the old
file or the new one, never a part of either.

* **The temporary name**: ``.<name>.tmp-<pid>-<8 hex><suffix>`` in the
  target's folder (the same file system, so the rename is atomic), ending in
  the target's own suffix (``.keras``, ``.weights.h5``, ``.png``,
  ``.tflite``...): Keras's checks of the extension pass and matplotlib picks
  the same format. Starting with a dot, it is hidden and matches no
  ``ModelCheckpoint`` file pattern that starts with text.
* **Durability**: the file (every file of a folder) is flushed to disk
  (``fsync``) before the rename and the folder after it, so that a power cut,
  not only a killed process, leaves the old file or the new one.
* **Stale temporaries**: a process killed mid-save leaves its temporary
  behind. The next save into the same folder removes every temporary of this
  form whose process is gone (or is this process, outside a save), and
  nothing else.
* **Folders** (a SavedModel): written beside the target and swapped with it
  in one step where the system can (Linux's ``renameat2(RENAME_EXCHANGE)``),
  then the old one is removed. Elsewhere the old folder is renamed aside
  (``.<name>.old-<pid>-<hex>``) before the new one is renamed in; a kill
  between the two renames is repaired by the next save (the old folder
  comes back first).

A symbolic link as the target is followed (the file it points to is
replaced, as writing through ``open`` would). Floor 0: :mod:`keras_mp._saves`
applies it to Keras's saving; :func:`keras_mp.export` and
:func:`keras_mp.plot_precision` use it directly.

Example:
    >>> import os, tempfile
    >>> from keras_mp._atomic import atomic_path
    >>> folder = tempfile.mkdtemp()
    >>> target = os.path.join(folder, "notes.txt")
    >>> with atomic_path(target) as tmp:
    ...     with open(tmp, "w") as f:
    ...         _ = f.write("new")
    >>> os.path.basename(tmp).startswith(".notes.txt.tmp-"), tmp.endswith(".txt")
    (True, True)
    >>> open(target).read(), os.listdir(folder)
    ('new', ['notes.txt'])
    >>> try:
    ...     with atomic_path(target) as tmp:
    ...         with open(tmp, "w") as f:
    ...             _ = f.write("half")
    ...         raise OSError("disk full")
    ... except OSError:
    ...     pass
    >>> open(target).read(), os.listdir(folder)  # the old file, no temporary
    ('new', ['notes.txt'])
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Iterator

__all__ = ["atomic_path", "clean_stale", "fsync_path", "suffix_of", "temporaries"]

#: Suffixes of more than one part that Keras insists on (else the last one counts).
COMPOUND_SUFFIXES = (".weights.h5", ".weights.json")

_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}"
                        r"(?P<suffix>.*)$")
_in_flight: set[str] = set()  # this process's temporaries being written now
_lock = threading.Lock()


def suffix_of(name: str) -> str:
    """The suffix a temporary for ``name`` keeps: ``".weights.h5"`` for
    ``"m.weights.h5"``, ``".keras"`` for ``"m.keras"``, ``""`` for ``"m"``."""
    return next((s for s in COMPOUND_SUFFIXES if name.endswith(s)), os.path.splitext(name)[1])


def temporaries(folder: str) -> list[str]:
    """The names in ``folder`` that :func:`atomic_path` writes or sets aside."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in names if _parse(n) is not None)


def _parse(name: str):
    m = _TEMPORARY.match(name)
    if m is None or m["suffix"] not in ("", suffix_of(m["name"])):
        return None
    return m


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # another user's process, or no way to tell: keep its files
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def clean_stale(folder: str) -> list[str]:
    """Removes the temporaries in ``folder`` that no save is writing: those
    of processes that are gone, and this process's own outside a save. A
    folder set aside by a swap that was cut short goes back to its name if
    nothing took that name. Returns the names removed or restored."""
    done = []
    for name in temporaries(folder):
        path = os.path.join(folder, name)
        m = _parse(name)
        pid = int(m["pid"])
        with _lock:
            busy = path in _in_flight or (pid != os.getpid() and _alive(pid))
        if busy:
            continue
        target = os.path.join(folder, m["name"])
        if m["kind"] == "old" and not os.path.lexists(target):
            with contextlib.suppress(OSError):
                os.rename(path, target)  # the old state back where it was
                done.append(name)
                continue
        _remove(path)
        done.append(name)
    return done


def fsync_path(path: str) -> None:
    """Flushes a file, or a folder's entries, to disk (where the system
    allows it: not every system can open a folder)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(root, f))
        fsync_path(root)


def _exchange(a: str, b: str) -> bool:
    """Swaps two paths in one step (Linux renameat2 RENAME_EXCHANGE); False
    where the system or the file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), b)


def _swap_in(tmp: str, target: str) -> None:
    """Puts the folder ``tmp`` at ``target``; what was at ``target`` ends at ``tmp``."""
    if not os.path.lexists(target):
        os.rename(tmp, target)
        return
    if _exchange(tmp, target):
        return
    folder, name = os.path.split(target)
    aside = os.path.join(folder, f".{name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(target, aside)
    os.rename(tmp, target)
    os.rename(aside, tmp)  # removed with the temporary


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, *, directory: bool = False) -> Iterator[str]:
    """Yields a temporary path beside ``target`` to write; when the block
    ends without an error, moves what was written there into place in one
    step. On an error the temporary is removed and ``target`` is left as it
    was.

    Args:
        target: the file (or, with ``directory=True``, the folder) to write.
            Its folder must exist.
        directory: the block writes a folder at the temporary path (it does
            not exist yet when the block starts).

    Raises:
        FileNotFoundError: ``target``'s folder does not exist.
        IsADirectoryError: a file is to replace a folder.
        NotADirectoryError: a folder is to replace a file.
    """
    target = os.fspath(target)
    if os.path.islink(target):
        target = os.path.realpath(target)
    folder, name = os.path.split(os.path.abspath(target))
    if not os.path.isdir(folder):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), target)
    if not directory and os.path.isdir(target):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), target)
    if directory and os.path.exists(target) and not os.path.isdir(target):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), target)
    clean_stale(folder)
    suffix = "" if directory else suffix_of(name)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}{suffix}")
    with _lock:
        _in_flight.add(tmp)
    try:
        yield tmp
        if directory:
            _fsync_tree(tmp)
            _swap_in(tmp, target)
        else:
            fsync_path(tmp)
            if os.path.isfile(target):  # the new file keeps the old one's permissions
                os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
            os.replace(tmp, target)
        fsync_path(folder)
    finally:
        _remove(tmp)  # the failed write, or the old folder swapped out
        with _lock:
            _in_flight.discard(tmp)
