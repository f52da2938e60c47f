"""Facts about the TensorFlow graph being built that decide how our ops run in it."""
from __future__ import annotations

import tensorflow as tf

__all__ = ["check_not_xla", "ordered"]


def check_not_xla(what: str) -> None:
    """A Python kernel cannot run inside an XLA cluster: say so at trace time."""
    from tensorflow.python.ops import control_flow_util

    graph = tf.compat.v1.get_default_graph()
    if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(graph):
        raise ValueError(f"collective '{what}' runs Python code, which XLA cannot compile; "
                         "compile the model with jit_compile=False (Keras picks XLA on GPUs "
                         "when jit_compile='auto') or use tf.function without jit_compile")


def ordered() -> bool:
    """Whether TensorFlow runs the stateful ops of the graph being built in program order
    (tf.function's automatic control dependencies), so that every rank runs our blocking
    kernels in one order; elsewhere (a tf.compat.v1 graph) they run as async ops."""
    graph = tf.compat.v1.get_default_graph()
    return bool(getattr(graph, "_add_control_dependencies", False))
