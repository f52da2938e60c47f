"""What a job asks of its Spark session, whether classic or Spark Connect.

Terms.  A *classic* session has a SparkContext in this process (py4j to the JVM
driver).  A *Connect* session (`pyspark.sql.connect`) is a gRPC client of a Spark
driver that runs elsewhere, the *server*: no SparkContext, no JVM here, only what
the DataFrame API and the session's configuration carry.  The *client* is the
process that submits the job (a notebook, a script): on classic it is the driver.

A job asks its session for: configuration values (`conf`), the master, the address
the executors reach the client at (`client_host`), the barrier task slots, a tag
to cancel its stage by, and the barrier stage itself (`barrier_rows`).

The barrier stage is one DataFrame stage on both kinds:
``spark.range(np, numPartitions=np).mapInArrow(body, schema, barrier=True)``
(Connect carries DataFrame plans, not RDDs); partition = task = rank.

The client's address.  Classic: spark.driver.host, which the executors reach
already.  Connect: the executors may not reach the client at all (a laptop, a
notebook behind NAT).  Where the server runs on this machine (a loopback
address), they do: on 127.0.0.1 with a local master, at the server's
spark.driver.host when it drives a cluster from here (an address of this
machine; not one behind a tunnel); where HOROVOD_SPARK_CLIENT_ADDRESS names an
address, they are taken to; where it says ``none``, they do not; otherwise the
live output is tried on the address this machine reaches the server from (best
effort: a failure still comes back with the stage), and the ranks meet at rank
0's task store (`reachable` is False).

Slots.  Classic counts the free slots of the executors registered now.  A
Connect client cannot ask the scheduler; it counts what the configuration
promises (local[N], local-cluster, executor instances x cores), and where that
says nothing, says so once and leaves the wait to Spark.
"""
from __future__ import annotations

import functools
import ipaddress
import socket
import warnings
from typing import Callable, Iterator, List, NamedTuple, Optional, Tuple
from urllib.parse import urlparse

__all__ = ["Cluster", "TaskRow", "is_connect", "to_arrow", "STAGE_SCHEMA"]

STAGE_SCHEMA = "rank int, result binary, output string"
_told: set = set()  # what could not be checked, said once per process


def is_connect(spark) -> bool:
    """Whether `spark` is a Spark Connect session (a client with no SparkContext here)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


class _ConnectConf:
    """`get(key, default)` over a Connect session's runtime configuration, each key asked once."""

    def __init__(self, spark) -> None:
        self._spark, self._seen = spark, {}

    def get(self, key: str, default=None):
        if key not in self._seen:
            self._seen[key] = self._spark.conf.get(key, None)
        value = self._seen[key]
        return default if value is None else value


class Cluster:
    """The session's answers to the job's questions (see the module docstring)."""

    def __init__(self, spark, client_address: str = "") -> None:
        self.spark, self.connect = spark, is_connect(spark)
        if self.connect:
            self.sc, self.conf = None, _ConnectConf(spark)
            self.master = str(self.conf.get("spark.master", ""))
        else:
            self.sc = spark.sparkContext
            self.conf, self.master = self.sc.getConf(), self.sc.master
        self.client_host, self.reachable = self._client(client_address.strip())

    @property
    def kind(self) -> str:
        return "Spark Connect" if self.connect else "classic Spark"

    # -- the client's address --------------------------------------------------
    def _client(self, given: str) -> Tuple[Optional[str], bool]:
        if not self.connect:
            return self.conf.get("spark.driver.host", "127.0.0.1"), True
        if given.lower() == "none":
            return None, False
        if given:
            return given, True
        host, port = _server_endpoint(self.spark)
        if host is None:
            return None, False
        if _is_loopback(host):
            return loopback_client(self.master, str(self.conf.get("spark.driver.host", "")))
        return _route_address(host, port), False

    # -- slots ---------------------------------------------------------------
    def available_slots(self) -> Optional[int]:
        """Barrier task slots free now (classic), or promised by the configuration (Connect),
        or None where nothing says."""
        from .checks import expected_slots, local_slots

        if not self.connect:
            jsc = self.sc._jsc.sc()
            profile = jsc.resourceProfileManager().defaultResourceProfile()
            return int(jsc.maxNumConcurrentTasks(profile))
        local = local_slots(self.conf, self.master)
        return local if local is not None else expected_slots(self.conf, self.master)

    def executors(self) -> Optional[int]:
        if self.connect:
            return None
        n = int(self.sc._jsc.sc().getExecutorMemoryStatus().size())
        return n if self.master.startswith("local") else max(n - 1, 0)  # the driver is listed

    def default_parallelism(self) -> int:
        if not self.connect:
            return self.sc.defaultParallelism
        value = self.conf.get("spark.default.parallelism")
        slots = int(value) if value else self.available_slots()
        if not slots:
            raise ValueError(f"cannot tell the default parallelism of the Spark Connect session "
                             f"(master {self.master or 'unknown'}, no spark.default.parallelism): "
                             f"pass num_proc")
        return slots

    def tell_once(self, what: str, say: Callable[[str], None]) -> None:
        if what not in _told:
            _told.add(what)
            say(what)

    # -- the stage -----------------------------------------------------------
    def tag(self, tag: str) -> None:
        if self.connect:
            self.spark.addTag(tag)
        else:
            self.sc.addJobTag(tag)

    def cancel(self, tag: str) -> None:
        """Cancel (interrupt) what runs under the tag, from any thread."""
        if self.connect:
            self.spark.interruptTag(tag)
        else:
            self.sc.cancelJobsWithTag(tag)

    def untag(self, tag: str, cancel: bool) -> None:
        """Forget the tag; first cancel (interrupt) what still runs under it."""
        if self.connect:
            try:
                if cancel:
                    self.spark.interruptTag(tag)
            finally:
                self.spark.removeTag(tag)
            return
        if cancel:
            self.sc.cancelJobsWithTag(tag)
        self.sc.removeJobTag(tag)

    #: The classic session's stage: "rdd" (a barrier RDD), or "dataframe" (the one Connect
    #: runs).  benchmarks/launch.py compares them: ranks fork warm in both, but a fresh Arrow
    #: worker (Spark replaces workers idle for a minute) imports pandas and pyarrow before
    #: the task runs, so the DataFrame stage cost 2-2.7x the RDD's there; classic keeps it.
    classic_stage = "rdd"

    def barrier_rows(self, np_: int, task: Callable[[Iterator], Iterator]) -> List["TaskRow"]:
        """Run `task` (a mapPartitions body yielding one TaskRow) as a barrier stage of np_
        tasks; its rows."""
        if not self.connect and self.classic_stage == "rdd":
            return list(self.sc.parallelize(range(np_), np_).barrier().mapPartitions(task).collect())
        body = functools.partial(_arrow_body, task)
        with warnings.catch_warnings():  # PySpark's own pandas-version notice, not the user's
            warnings.filterwarnings("ignore", "PySpark does not yet fully support pandas")
            rows = self.spark.range(np_, numPartitions=np_).mapInArrow(
                body, STAGE_SCHEMA, barrier=True).collect()
        return [TaskRow(r.rank, bytes(r.result) if r.result is not None else None, r.output)
                for r in rows]


class TaskRow(NamedTuple):
    """One task's row of the runner's barrier stage."""
    rank: int
    result: Optional[bytes]       # the rank's encoded RankResult (b"": sent to the job store)
    output: Optional[str] = None  # JSON of the output lines no live channel took


def _arrow_body(task: Callable[[Iterator], Iterator], batches: Iterator) -> Iterator:
    """The mapInArrow body: the task's TaskRow as one Arrow row."""
    import pyarrow as pa

    for _ in batches:  # the range's numbers: the partition id is the rank
        pass
    for row in task(iter(())):
        yield pa.RecordBatch.from_arrays(
            [pa.array([row.rank], pa.int32()), pa.array([row.result], pa.binary()),
             pa.array([row.output], pa.string())], names=["rank", "result", "output"])


# --------------------------------------------------------------------------- Connect's server

def _server_endpoint(spark) -> Tuple[Optional[str], int]:
    """(host, port) of the Connect server this session talks to, where the client says."""
    client = getattr(spark, "client", None) or getattr(spark, "_client", None)
    builder = getattr(client, "_builder", None)
    url = getattr(builder, "url", None) or getattr(builder, "_url", None)
    host = getattr(builder, "host", None) or getattr(builder, "_host", None)
    port = getattr(builder, "_port", None)
    if host is None and isinstance(url, str):
        parsed = urlparse(url.replace("sc://", "http://", 1).split(";")[0])
        host, port = parsed.hostname, parsed.port
    return host, int(port or 15002)


def loopback_client(master: str, driver_host: str) -> Tuple[Optional[str], bool]:
    """Where the executors reach a client whose Connect server is on its own loopback: on
    127.0.0.1 where they run on this machine too (a local master); else at the server's
    driver host, where that is an address of this machine (the server drives a cluster from
    here); else not at all (a tunnel to a server elsewhere)."""
    if master.startswith("local"):
        return "127.0.0.1", True
    if driver_host and not _is_loopback(driver_host) and _is_own_address(driver_host):
        return driver_host, True
    return None, False


def _is_own_address(host: str) -> bool:
    try:
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family[0], socket.SOCK_STREAM) as s:
            s.bind(family[4][:2])
        return True
    except OSError:
        return False


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _route_address(host: str, port: int) -> Optional[str]:
    """The address this machine reaches `host` from (no packet is sent)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family[0], socket.SOCK_DGRAM) as s:
            s.connect(family[4])
            return s.getsockname()[0]
    except OSError:
        return None


# --------------------------------------------------------------------------- Arrow

def to_arrow(df):
    """The DataFrame's rows as one pyarrow Table, on pyspark 3.5 and 4, classic and Connect."""
    if hasattr(df, "toArrow"):  # pyspark >= 4.0
        return df.toArrow()
    import pyarrow as pa

    if is_connect(df):  # pyspark 3.5's Connect client
        table, _ = df._session.client.to_table(df._plan.to_proto(df._session.client))
        return table
    from pyspark.sql.pandas.types import to_arrow_schema

    schema = to_arrow_schema(df.schema)
    batches = df._collect_as_arrow()
    return pa.Table.from_batches(batches, schema=schema) if batches else schema.empty_table()

