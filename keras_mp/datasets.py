"""Data the package ships, so that the demo, tests and tutorials run offline."""

from __future__ import annotations

from importlib import resources

import numpy as np

__all__ = ["load_digits"]


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
    if not isinstance(test_fraction, (int, float)) or not 0.0 < test_fraction < 1.0:
        raise ValueError(f"`test_fraction` must be in (0, 1), got {test_fraction!r}.")
    with resources.files("keras_mp.data").joinpath("digits.npz").open("rb") as f:
        data = np.load(f)
        images, labels = data["images"], data["labels"]
    order = np.random.default_rng(seed).permutation(len(labels))
    x = (images[order].astype("float32") / 16.0)[..., None]
    y = labels[order].astype("int32")
    n_test = int(round(len(y) * test_fraction))
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])
