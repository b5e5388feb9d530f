"""Data for the demo, tests and tutorials, with no network needed.

Two ways in:

* :func:`load_digits`: the embedded 8x8 digits as NumPy arrays.
* :func:`load`: a ``tensorflow_datasets`` data set through
  ``tfds.load(name, data_dir=...)``. Offline (the default, and in CI) the
  name is ``"keras_mp_digits"``, a real TFDS builder
  (:class:`KerasMpDigits`) that writes the embedded digits as a TFDS data set
  under ``data_dir`` the first time; with internet any TFDS name (``"mnist"``,
  ``"cifar10"``, ...) goes through the same call. So a tutorial written
  against :func:`load` runs unchanged on both.

Nothing here downloads unless asked: the offline builder reads the package's
own file, and :func:`load` passes ``download=False`` (and never tries TFDS's
GCS mirror) unless ``download=True``.

``tensorflow_datasets`` is imported only when :func:`load` or
:func:`prepare_digits` runs (it is the ``data`` extra).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import os
from importlib import resources
from typing import Any

import numpy as np

from keras_mp import _checks as checks

__all__ = ["load_digits", "load", "prepare_digits", "Loaded", "DIGITS_NAME",
           "default_data_dir", "default_name"]

#: The TFDS name of the embedded digits.
DIGITS_NAME = "keras_mp_digits"
_DIGITS_SPLIT = {"test_fraction": 0.2, "seed": 0}


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    with resources.files("keras_mp.data").joinpath("digits.npz").open("rb") as f:
        data = np.load(f)
        return data["images"], data["labels"]


def load_digits(test_fraction: float = 0.2, seed: int = 0):
    """The embedded 8x8 handwritten digits (1,797 images, 10 classes).

    Args:
        test_fraction: share of the images held out for testing, in (0, 1).
        seed: seed of the shuffle that splits train from test.

    Returns:
        ``(x_train, y_train), (x_test, y_test)``: images as float32 in [0, 1]
        with shape ``[n, 8, 8, 1]``, labels as int32.

    Example:
        >>> from keras_mp.datasets import load_digits
        >>> (x, y), (xt, yt) = load_digits()
        >>> x.shape, xt.shape, int(y.max())
        ((1438, 8, 8, 1), (359, 8, 8, 1), 9)
    """
    if not checks.is_number(test_fraction) or not 0.0 < test_fraction < 1.0:
        raise ValueError(f"`test_fraction` must be in (0, 1), got {test_fraction!r}.")
    _check_seed(seed)
    images, labels = _digits_arrays()
    order = np.random.default_rng(seed).permutation(len(labels))
    x = (images[order].astype("float32") / 16.0)[..., None]
    y = labels[order].astype("int32")
    n_test = int(round(len(y) * test_fraction))
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def _check_seed(seed: Any) -> None:
    if not checks.is_integer(seed) or seed < 0:
        raise TypeError(f"`seed` must be an int >= 0, got {seed!r}.")


def default_data_dir() -> str | None:
    """Where :func:`load` prepares and reads data when ``data_dir`` is None:
    ``$KERAS_MP_DATA_DIR`` if set, else None (TFDS's own default,
    ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``)."""
    return os.environ.get("KERAS_MP_DATA_DIR") or None


def _data_dir(data_dir: str | os.PathLike | None) -> str | None:
    # "~/tensorflow_datasets" means the home folder, not a folder named "~".
    data_dir = os.fspath(data_dir) if data_dir is not None else default_data_dir()
    return os.path.expanduser(data_dir) if data_dir is not None else None


def default_name() -> str:
    """The data set :func:`load` uses when ``name`` is None:
    ``$KERAS_MP_DATASET`` if set (e.g. ``mnist`` on a machine with internet),
    else ``"keras_mp_digits"``."""
    return os.environ.get("KERAS_MP_DATASET") or DIGITS_NAME


def _builder_class():
    """Defines (once) and returns the TFDS builder of the embedded digits.

    Defined lazily so that importing keras_mp does not import
    tensorflow_datasets; defining the class registers it with TFDS, so
    ``tfds.load("keras_mp_digits")`` finds it afterwards.
    """
    global KerasMpDigits
    if KerasMpDigits is not None:
        return KerasMpDigits
    import tensorflow_datasets as tfds

    # Named KerasMpDigits because TFDS registers a builder under the snake
    # case of its class name, at class creation.
    class KerasMpDigits(tfds.core.GeneratorBasedBuilder):
        """The 1,797 8x8 digits shipped in ``keras_mp/data/digits.npz``.

        Splits ``train`` (1,438) and ``test`` (359) are exactly
        ``load_digits()``'s, in the same order. ``image`` is float32 in
        [0, 1], shape ``[8, 8, 1]``; ``label`` a ClassLabel of 10 digits.
        """

        VERSION = tfds.core.Version("1.0.0")
        RELEASE_NOTES = {"1.0.0": "The scikit-learn/UCI digits, split 80/20 with seed 0."}

        def _info(self) -> tfds.core.DatasetInfo:
            return self.dataset_info_from_configs(
                description="8x8 handwritten digits (UCI optical digits test set, as "
                            "shipped by scikit-learn), embedded in keras-mp.",
                features=tfds.features.FeaturesDict({
                    # Tensor, not Image: pixels are 0..16 in the source, and a
                    # float in [0, 1] keeps them exact.
                    "image": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.float32),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }),
                supervised_keys=("image", "label"),
                homepage="https://archive.ics.uci.edu/dataset/80",
                license="CC BY 4.0",
                # Keeps load_digits()'s order, so the two can be compared.
                disable_shuffling=True,
            )

        def _split_generators(self, dl_manager):
            (x, y), (xt, yt) = load_digits(**_DIGITS_SPLIT)
            return {"train": self._generate_examples(x, y),
                    "test": self._generate_examples(xt, yt)}

        def _generate_examples(self, x, y):
            for i, (image, label) in enumerate(zip(x, y)):
                yield i, {"image": image, "label": int(label)}

    assert KerasMpDigits.name == DIGITS_NAME, KerasMpDigits.name
    return KerasMpDigits


#: The TFDS builder class (a ``tfds.core.GeneratorBasedBuilder``); None until
#: :func:`prepare_digits` or :func:`load` first needs it.
KerasMpDigits: Any = None


def prepare_digits(data_dir: str | os.PathLike | None = None, *, verbose: bool = False):
    """Writes the embedded digits as a TFDS data set under ``data_dir``
    (once; later calls reuse it) and returns the builder.

    Args:
        data_dir: the TFDS data directory; :func:`default_data_dir` when None.
        verbose: show TFDS's messages and progress bars while it writes
            (it announces "Downloading and preparing", though nothing is
            downloaded).

    Returns:
        The ``tfds.core.DatasetBuilder``, prepared.

    Example:
        >>> import tempfile
        >>> from keras_mp import datasets
        >>> b = datasets.prepare_digits(tempfile.mkdtemp())
        >>> b.info.splits["train"].num_examples, b.info.splits["test"].num_examples
        (1438, 359)
    """
    import tensorflow_datasets as tfds

    if data_dir is not None and not isinstance(data_dir, (str, os.PathLike)):
        raise TypeError(f"`data_dir` must be a path or None, got {data_dir!r}.")
    data_dir = _data_dir(data_dir)
    if not isinstance(verbose, bool):
        raise TypeError(f"`verbose` must be True or False, got {verbose!r}.")
    builder = _builder_class()(data_dir=data_dir)
    quiet = contextlib.nullcontext() if verbose else _captured_output()
    with quiet:
        # try_download_gcs=False: TFDS would otherwise ask its GCS bucket for
        # a prepared copy first (a network call, and a hang when offline).
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
            try_download_gcs=False))
    return builder


@contextlib.contextmanager
def _captured_output():
    """Swallows Python-level stdout/stderr (TFDS's prints and tqdm bars);
    exceptions still propagate."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


@dataclasses.dataclass
class Loaded:
    """What :func:`load` returns.

    Attributes:
        train: ``tf.data.Dataset`` of ``(image, label)`` batches, shuffled
            each epoch; images float32 in [0, 1], labels int32.
        test: the same for the test split, not shuffled.
        info: the ``tfds.core.DatasetInfo``.
        input_shape: the image shape, e.g. ``(8, 8, 1)``.
        num_classes: the number of labels.
        num_train: examples used from the train split.
        num_test: examples used from the test split.
    """

    train: Any
    test: Any
    info: Any
    input_shape: tuple[int, ...]
    num_classes: int
    num_train: int
    num_test: int


def _check_count(name: str, value: Any) -> None:
    if value is not None and (not checks.is_integer(value) or value < 1):
        raise ValueError(f"`{name}` must be None or an int >= 1, got {value!r}.")


def _unknown_name(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name.split(":")[0].split("/")[0],
                                      [DIGITS_NAME, *known], n=3, cutoff=0.6)
    hint = f"; close matches: {', '.join(close)}" if close else ""
    return (f"`name` {name!r} is not a TFDS data set{hint} (tfds.list_builders() lists all "
            f"{len(known)}; {DIGITS_NAME!r} works offline).")


def load(name: str | None = None, *, data_dir: str | os.PathLike | None = None,
         batch_size: int = 64, max_train: int | None = None, max_test: int | None = None,
         download: bool = False, seed: int = 0) -> Loaded:
    """Loads a TFDS image-classification data set through
    ``tfds.load(name, data_dir=data_dir)`` as batched ``tf.data`` pipelines.

    Args:
        name: a TFDS name with ``image``/``label`` features, e.g.
            ``"keras_mp_digits"`` (offline; prepared under ``data_dir`` on
            first use), ``"mnist"`` or ``"cifar10"``; :func:`default_name`
            when None.
        data_dir: the TFDS data directory; :func:`default_data_dir` when None.
        batch_size: examples per batch, an int >= 1.
        max_train: use at most this many training examples (e.g. a small
            "smoke" run); None: all.
        max_test: the same for the test split.
        download: let TFDS download ``name`` if it is not prepared in
            ``data_dir`` (needs internet). Off by default so that nothing
            touches the network unless asked. Not needed for
            ``"keras_mp_digits"``.
        seed: seed of the per-epoch shuffle of the training data.

    Returns:
        A :class:`Loaded`.

    Raises:
        ValueError: on a bad argument, or if ``name`` is not prepared in
            ``data_dir`` and ``download`` is False (the message says how to fix it).

    Example:
        >>> import tempfile
        >>> from keras_mp import datasets
        >>> d = datasets.load("keras_mp_digits", data_dir=tempfile.mkdtemp(),
        ...                   batch_size=32, max_train=64)
        >>> d.input_shape, d.num_classes, d.num_train
        ((8, 8, 1), 10, 64)
        >>> x, y = next(iter(d.train))
        >>> x.shape, x.dtype.name, y.dtype.name
        (TensorShape([32, 8, 8, 1]), 'float32', 'int32')
    """
    name = default_name() if name is None else name
    if not isinstance(name, str) or not name:
        raise ValueError(f"`name` must be a TFDS data set name such as {DIGITS_NAME!r} or "
                         f"'mnist', got {name!r}.")
    batch_size = checks.count("batch_size", batch_size, 1)
    _check_count("max_train", max_train)
    _check_count("max_test", max_test)
    if not isinstance(download, bool):
        raise TypeError(f"`download` must be True or False, got {download!r}.")
    _check_seed(seed)
    if data_dir is not None and not isinstance(data_dir, (str, os.PathLike)):
        raise TypeError(f"`data_dir` must be a path or None, got {data_dir!r}.")

    import tensorflow as tf
    import tensorflow_datasets as tfds

    data_dir = _data_dir(data_dir)
    if name.split(":")[0].split("/")[0] == DIGITS_NAME:
        prepare_digits(data_dir)
    try:
        (train, test), info = tfds.load(
            name, split=["train", "test"], data_dir=data_dir, as_supervised=True,
            with_info=True, download=download, try_gcs=False,
            download_and_prepare_kwargs={"download_config": tfds.download.DownloadConfig(
                try_download_gcs=False)} if download else None)
    except tfds.core.DatasetNotFoundError:
        # TFDS's message lists its whole catalogue (hundreds of lines).
        raise ValueError(_unknown_name(name, tfds.list_builders())) from None
    except (AssertionError, FileNotFoundError) as e:
        # TFDS raises AssertionError when the data is not prepared and
        # download=False.
        raise ValueError(
            f"Data set {name!r} is not prepared under data_dir={data_dir!r} and "
            f"`download` is False. Pass download=True (needs internet), or use "
            f"name={DIGITS_NAME!r}, which is prepared offline. ({e})") from e

    image = info.features["image"]
    scale = 255.0 if image.np_dtype == np.uint8 else 1.0

    def to_float(x, y):
        return tf.cast(x, tf.float32) / scale, tf.cast(y, tf.int32)

    n_train = info.splits["train"].num_examples
    n_test = info.splits["test"].num_examples
    if max_train is not None:
        train, n_train = train.take(max_train), min(n_train, max_train)
    if max_test is not None:
        test, n_test = test.take(max_test), min(n_test, max_test)
    # Cached after decoding: the digits are tiny, and small smoke runs of
    # larger sets fit too; shuffling after the cache gives a new order per epoch.
    train = (train.map(to_float, num_parallel_calls=tf.data.AUTOTUNE).cache()
             .shuffle(min(n_train, 10_000), seed=seed, reshuffle_each_iteration=True)
             .batch(batch_size).prefetch(tf.data.AUTOTUNE))
    test = (test.map(to_float, num_parallel_calls=tf.data.AUTOTUNE).cache()
            .batch(batch_size).prefetch(tf.data.AUTOTUNE))
    return Loaded(train=train, test=test, info=info, input_shape=tuple(image.shape),
                  num_classes=int(info.features["label"].num_classes),
                  num_train=int(n_train), num_test=int(n_test))
