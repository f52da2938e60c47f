"""Nothing is unpickled from an unauthenticated peer.

The grep-level test walks the syntax tree of every module of the package and
finds each call that can unpickle (pickle/cloudpickle `loads`/`load`/
`Unpickler`, `torch.load` without `weights_only=True`, `numpy.load` with
`allow_pickle=True`).  Every such call site must be listed in REVIEWED with
the channel its bytes come from; a new one fails until someone reviews it
and says why its bytes can be trusted.  The behavioural tests send a pickle
that would leave a file behind to every channel an outsider can reach.
"""
from __future__ import annotations

import ast
import base64
import os
import pathlib

import cloudpickle
import pytest

import _fault_attacks as attacks

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("collectives", "horovod_spark")
PICKLERS = {"pickle", "cloudpickle", "_pickle", "dill"}

AUTH_STORE = "a TCPStore/StoreServer connection, which runs the mutual HMAC handshake first"
OWN_CHANNEL = ("the rank's own channel, a socketpair between the rank and its launcher that "
               "no other process holds (collectives/launch/channel.py)")
TASK_KEY = ("the driver's job store or log server, which authenticate with the task key: "
            "only the job's tasks hold it, never a rank")
MESH = "bytes received over the authenticated mesh (every peer proved the job secret)"
SPARK = "Spark's own task-result channel (collect()), which PySpark itself unpickles"
USER_MODEL = "the model the user's own job pickled, from a Spark broadcast or the user's Store"
#: (file, function) -> where the bytes come from and why that is trusted.
REVIEWED = {
    ("collectives/launch/worker.py", "_load"): "the job payload, from its launcher on "
                                              + OWN_CHANNEL,
    ("collectives/launch/procs.py", "RankFailed.original"): "a rank's exception, from "
                                                      + OWN_CHANNEL + "; on Spark, from "
                                                      + TASK_KEY,
    ("collectives/launch/record.py", "RankResult.value"): "a rank's result: from "
                                                        + OWN_CHANNEL + "; on Spark, through "
                                                        + SPARK + " or " + TASK_KEY,
    ("horovod_spark/estimator/_torch_io.py", "loads_model"): USER_MODEL,
    ("horovod_spark/estimator/_keras_io.py", "loads_model"): USER_MODEL,
    ("horovod_spark/estimator/model.py", "_decoder"): "the fit's decode_fn, pickled with "
                                                      "the model by the user's own job: "
                                                      "inside the prediction UDF (Spark's "
                                                      "task channel), or from the user's "
                                                      "Store at load()",
    ("horovod_spark/estimator/_train_keras.py", "_fit"): "the estimator's spec, shipped by the "
                                                         "driver inside the barrier stage "
                                                         "(Spark's task channel)",
    ("horovod_spark/torch/functions.py", "broadcast_object"): MESH,
    ("horovod_spark/torch/functions.py", "allgather_object"): MESH,
    ("horovod_spark/tensorflow/_kernels.py", "broadcast_object"): MESH,
    ("horovod_spark/tensorflow/_kernels.py", "allgather_object"): MESH,
    ("horovod_spark/common/elastic.py", "run"): "the state rank 0 of an earlier attempt committed: "
                                          "written to and read back from the job's store over "
                                          + AUTH_STORE + " (the driver keeps it unread)",
}


def _kwarg(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name and isinstance(kw.value, ast.Constant):
            return kw.value.value
    return None


def _unpickles(call: ast.Call, aliases: dict) -> bool:
    f = call.func
    if isinstance(f, ast.Name):
        names = {f"{m}.{n}" for m in PICKLERS for n in ("loads", "load", "Unpickler")}
        return aliases.get(f.id) in names
    if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)):
        return False
    mod = aliases.get(f.value.id, f.value.id)
    if mod in PICKLERS and f.attr in ("loads", "load", "Unpickler"):
        return True
    if mod == "torch" and f.attr == "load":
        return _kwarg(call, "weights_only") is not True
    if mod in ("numpy", "np") and f.attr == "load":
        return _kwarg(call, "allow_pickle") is True
    return False


class _Finder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.scope: list = []
        self.aliases: dict = {}
        self.sites: list = []

    def visit_Import(self, node):
        for a in node.names:
            self.aliases[a.asname or a.name] = a.name

    def visit_ImportFrom(self, node):
        for a in node.names:
            self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def _scoped(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Call(self, node):
        if _unpickles(node, self.aliases):
            self.sites.append((".".join(self.scope) or "<module>", node.lineno))
        self.generic_visit(node)


def unpickling_sites() -> dict:
    """(file, function) -> [line numbers] of every call that can unpickle."""
    found: dict = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            finder = _Finder()
            finder.visit(ast.parse(path.read_text(), str(path)))
            rel = path.relative_to(ROOT).as_posix()
            for func, line in finder.sites:
                found.setdefault((rel, _outer(func)), []).append(line)
    return found


def _outer(func: str) -> str:
    """A nested helper is reviewed with the function that defines it."""
    parts = func.split(".")
    keep = [parts[0]]
    if len(parts) > 1 and parts[0][:1].isupper():  # Class.method
        keep.append(parts[1])
    return ".".join(keep)


def test_every_call_that_can_unpickle_reads_from_a_reviewed_authenticated_channel():
    unreviewed = {k: v for k, v in unpickling_sites().items() if k not in REVIEWED}
    assert not unreviewed, (
        "calls that can unpickle, not reviewed in tests/faults/test_unpickling.py REVIEWED: "
        + "; ".join(f"{f}:{lines} in {fn}()" for (f, fn), lines in sorted(unreviewed.items())))


def test_the_finder_sees_every_spelling_of_unpickling():
    src = ("import pickle, cloudpickle as cp, torch, numpy as np\nfrom pickle import loads\n"
           "def f(b):\n  pickle.loads(b); cp.loads(b); loads(b); torch.load(b)\n"
           "  torch.load(b, weights_only=True); np.load(b); np.load(b, allow_pickle=True)\n")
    finder = _Finder()
    finder.visit(ast.parse(src))
    assert [line for _, line in finder.sites] == [4, 4, 4, 4, 5]


# --------------------------------------------------------------------------- behaviour

MARKER_PICKLE = ("JobFailedError.original() unpickles the exc_blob of any failure record, and "
                 "records are also parsed out of Spark's exception text (parse_failure_markers), "
                 "which carries the rank's own traceback text: an exception message that contains "
                 "'HVS-FAILURE:<base64 JSON with exc_blob>' makes the driver unpickle it "
                 "(horovod_spark/_job/failure.py failure_of / markers.py parse_failure_markers; "
                 "fix: drop exc_blob from records parsed out of the exception text: the task "
                 "never puts it there)")


def test_a_failure_record_forged_in_spark_exception_text_is_never_unpickled(tmp_path):
    from horovod_spark._job.failure import JobFailedError, failure_of
    from horovod_spark._job.markers import failure_marker

    target = tmp_path / "unpickled"
    blob = base64.b64encode(cloudpickle.dumps(attacks.Bomb(str(target)))).decode()
    forged = failure_marker({"rank": 1, "size": 2, "error_type": "ValueError", "message": "x",
                             "exc_blob": blob})
    spark_text = f"Job aborted: ... ValueError: user data said {forged}\n"
    err = JobFailedError(failure_of(None, RuntimeError(spark_text), 2))
    err.original()
    assert not target.exists(), "the driver unpickled bytes from Spark's exception text"


def test_a_pickle_sent_to_the_launchers_store_without_the_secret_is_never_run(tmp_path):
    from collectives.rendezvous.store import TCPStore

    target = tmp_path / "unpickled"
    server = TCPStore.serve("127.0.0.1", os.urandom(32))
    try:
        blob = cloudpickle.dumps((attacks.Bomb(str(target)), (), {}))
        key = b"job/fn"
        frame = bytes([1]) + len(key).to_bytes(4, "big") + key + len(blob).to_bytes(8, "big") + blob
        attacks.attack_without_secret(server.address, frame)
        assert not server.check("job/fn")
    finally:
        server.close()
    assert not target.exists()

