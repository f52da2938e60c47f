"""Training programs of the distributor suites, as their users write them (no import of this
package): DeepSpeed, tf.distribute, JAX.  Pickled by value (see the bottom): Spark's
executors cannot import this module."""
from __future__ import annotations

import os
import sys

import cloudpickle

DS_CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
             "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
             "steps_per_print": 1000, "zero_allow_untested_optimizer": True}


def _ds_train(config, steps: int = 4):
    """A tiny regression trained by a DeepSpeed engine (ZeRO stage 1, the client's SGD: no
    op to build); each rank its own data; (backend, losses, parameters, rank)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    x = torch.randn(4, 8, generator=g)
    y = x.sum(1, keepdim=True)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    params = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    return {"backend": dist.get_backend(), "losses": losses, "rank": dist.get_rank(),
            "world": dist.get_world_size(), "params": params.tolist()}


def ds_function():
    """A function given the job's config by the distributor (its file's path)."""
    return _ds_train(os.environ["HOROVOD_SPARK_DEEPSPEED_CONFIG"])


def ds_all_ranks():
    """What every rank saw (run() returns every rank's value)."""
    return _ds_train(DS_CONFIG)


def ds_fails_on_rank_1():
    import deepspeed  # noqa: F401
    import torch.distributed as dist

    deepspeed.init_distributed()
    if dist.get_rank() == 1:
        raise ValueError("rank 1 has no data")
    dist.barrier()  # rank 0 waits here until the job is torn down
    return "unreachable"


DS_SCRIPT = '''
import argparse, json, os, sys
import deepspeed
parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
sys.path.insert(0, os.environ["DS_PROGRAMS"])
import _programs
result = _programs._ds_train(args.deepspeed_config)
result["deepspeed"], result["argv"] = args.deepspeed, sys.argv[1:]
with open(f"{args.out}.{result['rank']}", "w") as f:
    json.dump(result, f)
'''


def tf_custom_loop():
    """A custom step under the runner's MultiWorkerMirroredStrategy: every worker's value
    summed across the workers; (TF_CONFIG's workers, replicas, the sum)."""
    import json

    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    x = tf.constant([float(index + 1)])

    @tf.function
    def step():
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, x)

    out = strategy.experimental_local_results(strategy.run(step))[0]
    return {"workers": json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"],
            "replicas": strategy.num_replicas_in_sync, "sum": float(out[0]),
            "strategy": type(strategy).__name__}


def tf_keras_fit(epochs: int = 2, legacy: bool = True):
    """Keras' model.fit under the runner's strategy, on a dataset each worker shards: with
    tf_keras (Keras 2, legacy), or Keras 3 (which fails there: keras-team/keras#20585)."""
    import numpy as np
    import tensorflow as tf

    if legacy:
        import tf_keras as keras
    else:
        import keras
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(ds, epochs=epochs, verbose=0)
    return {"loss": history.history["loss"],
            "weights": [float(v) for v in np.ravel(model.get_weights()[0])]}


def tf_own_strategy():
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    outer = type(tf.distribute.get_strategy()).__name__  # the default: no runner's scope
    with strategy.scope():
        return {"replicas": strategy.num_replicas_in_sync, "outer": outer}


def tf_fails_on_rank_1():
    import json

    import tensorflow as tf

    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        raise ValueError("worker 1 gives up")
    x = tf.constant([1.0])

    @tf.function
    def step():  # waits for worker 1 until the job is torn down
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, x)

    return float(tf.distribute.get_strategy().run(step)[0])


def jax_sum_and_step():
    """jax.distributed.initialize() with no arguments; a sum over the processes' shards,
    and one gradient step of a linear model on data sharded over them."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize()
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    rows = NamedSharding(mesh, P("d"))
    me, n = jax.process_index(), jax.process_count()
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(
        jax.make_array_from_process_local_data(rows, np.full((1,), me + 1.0, np.float32)))
    x_all, y_all = jax_data(n)
    x = jax.make_array_from_process_local_data(rows, np.split(x_all, n)[me])
    y = jax.make_array_from_process_local_data(rows, np.split(y_all, n)[me])
    w = jax.device_put(jnp.zeros((3,), jnp.float32), NamedSharding(mesh, P()))
    w = jax.jit(jax_step, out_shardings=NamedSharding(mesh, P()))(w, x, y)
    return {"rank": me, "size": n, "sum": float(total), "w": np.asarray(w).tolist()}


def jax_data(n: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * n, 3)).astype(np.float32)
    return x, x @ np.array([1.0, -1.0, 2.0], np.float32)


def jax_step(w, x, y):
    import jax
    import jax.numpy as jnp

    loss = lambda w: jnp.mean((x @ w - y) ** 2)  # noqa: E731
    return w - 0.1 * jax.grad(loss)(w)


def jax_fails_on_rank_1():
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize()
    if jax.process_index() == 1:
        raise ValueError("process 1 gives up")
    import time
    time.sleep(300)  # rank 0 waits until the job is torn down


cloudpickle.register_pickle_by_value(sys.modules[__name__])
