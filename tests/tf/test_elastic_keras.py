"""hvd.elastic with Keras on two local ranks: the callbacks commit, a SIGKILLed rank's job
resumes from the last epoch committed, with the optimizer's state (one launch: TF starts slowly)."""
from __future__ import annotations

import pytest

from _tf_support import TF_ENV, requires_tf

import horovod_spark

pytestmark = [pytest.mark.tf, requires_tf, pytest.mark.timeout(240)]

STEPS, EPOCHS = 4, 3


def _fit(marker):
    import os
    import signal

    import keras
    import numpy as np

    import horovod_spark.keras as hvd

    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((STEPS * 4, 3)).astype("float32")
    y = x @ np.array([[1.0], [2.0], [3.0]], "float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5)),
                  loss="mse", jit_compile=False)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    class Die(keras.callbacks.Callback):  # rank 1, epoch 2 (index 1), batch 2, first attempt
        def on_train_batch_end(self, batch, logs=None):
            if hvd.rank() == 1 and state.epoch == 1 and batch == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

    @hvd.elastic.run
    def train(state):
        first = state.epoch
        model.fit(x, y, batch_size=4, steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch,
                  shuffle=False, verbose=0,
                  callbacks=[hvd.elastic.UpdateBatchStateCallback(state),
                             hvd.elastic.UpdateEpochStateCallback(state),
                             hvd.elastic.CommitStateCallback(state, batches_per_commit=STEPS), Die()])
        return first, state.epoch, state.batch, int(model.optimizer.iterations.numpy()), \
            [w.tolist() for w in model.get_weights()]

    return train(state)


def test_keras_callbacks_commit_and_a_killed_rank_resumes_from_the_last_epoch(tmp_path):
    out = horovod_spark.run_elastic(_fit, args=(str(tmp_path / "killed"),), num_proc=-2,
                                    reset_limit=1, env=TF_ENV)
    # resumed after epoch 1 (committed at its end), ran the two epochs left; the optimizer's
    # step count came back with the commit (4 + 8), so its slots did too
    assert [r[:4] for r in out] == [(1, EPOCHS, 0, STEPS * EPOCHS)] * 2
    assert out[0][4] == out[1][4]
