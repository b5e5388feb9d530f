"""The embedded digits, as arrays and as a TFDS data set loaded offline."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from keras_mp import datasets


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One prepared TFDS directory for the module (preparing takes seconds)."""
    path = tmp_path_factory.mktemp("tfds")
    datasets.prepare_digits(path)
    return path


def test_load_digits_shapes_and_split():
    (x, y), (xt, yt) = datasets.load_digits()
    assert x.shape == (1438, 8, 8, 1) and xt.shape == (359, 8, 8, 1)
    assert x.dtype == np.float32 and y.dtype == np.int32
    assert 0.0 <= x.min() and x.max() == 1.0
    assert set(np.unique(np.concatenate([y, yt]))) == set(range(10))


def test_load_digits_rejects_bad_fraction_and_seed():
    with pytest.raises(ValueError, match="test_fraction"):
        datasets.load_digits(test_fraction=1.5)
    for seed in ("zero", -1, True):
        with pytest.raises(TypeError, match="`seed`"):
            datasets.load_digits(seed=seed)


def test_prepared_data_set_is_on_disk_in_tfds_format(data_dir):
    version_dir = data_dir / datasets.DIGITS_NAME / "1.0.0"
    assert (version_dir / "dataset_info.json").exists()
    assert list(version_dir.glob("keras_mp_digits-train.tfrecord-*"))
    assert not list(data_dir.glob("**/incomplete*"))


def test_tfds_load_matches_load_digits(data_dir):
    (x, y), (xt, yt) = datasets.load_digits()
    for split, (ex, ey) in {"train": (x, y), "test": (xt, yt)}.items():
        images, labels = tfds.load(datasets.DIGITS_NAME, split=split, data_dir=str(data_dir),
                                   download=False, as_supervised=True, batch_size=-1)
        np.testing.assert_array_equal(images.numpy(), ex)
        np.testing.assert_array_equal(labels.numpy(), ey)
    info = tfds.builder(datasets.DIGITS_NAME, data_dir=str(data_dir)).info
    assert info.splits["train"].num_examples == 1438
    assert info.splits["test"].num_examples == 359
    assert info.features["label"].num_classes == 10


def test_prepare_twice_reuses_the_data(data_dir):
    info = data_dir / datasets.DIGITS_NAME / "1.0.0" / "dataset_info.json"
    before = info.stat().st_mtime_ns
    datasets.prepare_digits(data_dir)
    assert info.stat().st_mtime_ns == before


def test_load_batches_and_limits(data_dir):
    d = datasets.load(datasets.DIGITS_NAME, data_dir=data_dir, batch_size=50,
                      max_train=120, max_test=30)
    assert (d.input_shape, d.num_classes, d.num_train, d.num_test) == ((8, 8, 1), 10, 120, 30)
    sizes = [int(xb.shape[0]) for xb, _ in d.train]
    assert sizes == [50, 50, 20]
    xb, yb = next(iter(d.test))
    assert xb.dtype.name == "float32" and yb.dtype.name == "int32"
    assert xb.shape == (30, 8, 8, 1)
    (_, _), (xt, yt) = datasets.load_digits()
    np.testing.assert_array_equal(yb.numpy(), yt[:30])


def test_load_uses_environment_defaults(data_dir, monkeypatch):
    monkeypatch.setenv("KERAS_MP_DATA_DIR", str(data_dir))
    monkeypatch.delenv("KERAS_MP_DATASET", raising=False)
    d = datasets.load(max_train=10, max_test=10)
    assert d.info.name == datasets.DIGITS_NAME
    assert str(data_dir) in str(d.info.data_dir)


def test_data_dir_with_tilde_means_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    d = datasets.load(data_dir="~/tfds", batch_size=32, max_train=32, max_test=32)
    assert d.num_train == 32
    assert (tmp_path / "home" / "tfds" / datasets.DIGITS_NAME).is_dir()
    assert not (tmp_path / "~").exists()


def test_unprepared_data_set_does_not_download(tmp_path):
    # mnist is not prepared in an empty directory; with download=False TFDS
    # must not fetch it, and the error says what to do.
    with pytest.raises(ValueError, match="download=True"):
        datasets.load("mnist", data_dir=tmp_path)
    assert not (tmp_path / "mnist" / "3.0.1" / "dataset_info.json").exists()


@pytest.mark.parametrize("kwargs, argument", [
    ({"name": ""}, "name"),
    ({"batch_size": 0}, "batch_size"),
    ({"max_train": 0}, "max_train"),
    ({"max_test": 2.5}, "max_test"),
])
def test_load_rejects_bad_arguments(kwargs, argument, tmp_path):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        datasets.load(**{"data_dir": tmp_path, **kwargs})


def test_load_rejects_bad_download_and_data_dir(tmp_path):
    with pytest.raises(TypeError, match="`download`"):
        datasets.load(data_dir=tmp_path, download="yes")
    with pytest.raises(TypeError, match="`data_dir`"):
        datasets.load(data_dir=3)
    with pytest.raises(TypeError, match="`seed`"):
        datasets.load(data_dir=tmp_path, seed=1.5)


def test_prepare_is_quiet_unless_verbose(tmp_path, capsys):
    datasets.prepare_digits(tmp_path / "quiet")
    out, err = capsys.readouterr()
    assert "Downloading" not in out + err  # nothing is downloaded; TFDS says so anyway
    datasets.prepare_digits(tmp_path / "loud", verbose=True)
    out, _ = capsys.readouterr()
    assert "keras_mp_digits" in out
    with pytest.raises(TypeError, match="`verbose`"):
        datasets.prepare_digits(tmp_path, verbose=1)
