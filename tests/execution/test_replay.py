"""keras_mp.execution.replay: batches read once, fed again as an iterator of
the first one's exact element spec (the execution trial's calls and the probe
step's statistics step run Keras's traced train function on them)."""

import numpy as np
import pytest
import tensorflow as tf

from keras_mp.execution import replay, step_trial


def _iterator(x, y, batch, drop_remainder=False):
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=drop_remainder)
    return iter(dataset)


def test_the_batches_come_back_in_order_with_the_same_spec_and_values():
    x = np.arange(40, dtype="float32").reshape(10, 4)
    y = np.arange(10, dtype="int64")
    it = _iterator(x, y, 4)
    batches = [next(it), next(it)]
    again = replay.iterator_over(batches, it.element_spec)
    assert again.element_spec == it.element_spec
    got = list(again)
    assert len(got) == 2
    for (gx, gy), (bx, by) in zip(got, batches):
        np.testing.assert_array_equal(gx.numpy(), bx.numpy())
        np.testing.assert_array_equal(gy.numpy(), by.numpy())
    # A new iterator each time, over the same batches.
    assert [b[1].numpy().tolist() for b in replay.iterator_over(batches, it.element_spec)] == \
        [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_dict_inputs_and_a_fixed_batch_size_keep_their_spec():
    x = {"a": np.ones((8, 3), "float32"), "b": np.zeros((8, 2), "float32")}
    it = iter(tf.data.Dataset.from_tensor_slices((x, np.ones(8, "float32"))).batch(
        4, drop_remainder=True))
    assert it.element_spec[1].shape.as_list() == [4]
    again = replay.iterator_over([next(it)], it.element_spec)
    assert again is not None and again.element_spec == it.element_spec


def test_none_where_the_spec_cannot_be_made():
    x, y = np.ones((6, 2), "float32"), np.ones(6, "float32")
    fixed = _iterator(x, y, 4, drop_remainder=True)
    partial = (tf.ones([2, 2]), tf.ones([2]))  # 2 rows where the spec fixes 4
    assert replay.iterator_over([partial], fixed.element_spec) is None
    optional = (tf.experimental.Optional.empty(None), tf.ones([2]))
    assert replay.iterator_over([optional], fixed.element_spec) is None
    ragged = (tf.ragged.constant([[1.0], [2.0, 3.0]]), tf.ones([2]))
    assert replay.iterator_over([ragged], fixed.element_spec) is None
    assert replay.iterator_over([], fixed.element_spec) is None
    with pytest.raises(TypeError, match="`batches`"):
        replay.iterator_over((partial,), fixed.element_spec)


def test_the_trial_replays_without_a_python_generator():
    # A generator-backed dataset runs Python for every element inside the
    # timed call; the trial's replay is made from the tensors instead.
    x, y = np.ones((8, 2), "float32"), np.ones(8, "float32")
    it = _iterator(x, y, 4)
    make = step_trial._replayable(it, 2)
    first, second = make(), make()
    assert first is not second and first.element_spec == it.element_spec
    ops = {n.op for n in tf.compat.v1.GraphDef.FromString(
        first._dataset._as_serialized_graph().numpy()).node}
    assert "PyFunc" not in ops and "EagerPyFunc" not in ops
    assert "TensorSliceDataset" in ops
    assert [b[0].shape.as_list() for b in second] == [[4, 2], [4, 2]]
