"""Where an estimator's runs live: checkpoints each epoch and the final model.

Layout under the store's prefix::

    runs/<run_id>/checkpoints/epoch-000003.ckpt   the state after epoch 3 (0-based)
    runs/<run_id>/model.bin                       the trained model, written after the last epoch
    runs/<run_id>/history.json                    per-epoch metrics so far

A checkpoint is written to a temporary name and then renamed, so a reader never
sees half a file; the newest ``keep`` checkpoints are kept.  Fitting again with
the same run_id resumes from the newest checkpoint.  The training data never
goes through the store.

``Store.create(path)`` picks the implementation: a plain path or ``file://`` ->
``LocalStore``; ``dbfs:/x`` -> ``LocalStore('/dbfs/x')`` (Databricks' FUSE mount,
which every node sees); anything else (``hdfs://``, ``s3://``, ``gs://``, ...)
-> ``FilesystemStore`` over fsspec, or over a ``pyarrow.fs.FileSystem`` you pass.
Stores are pickled to the ranks, so they hold only picklable state.
"""
from __future__ import annotations

import json
import os
import re
import uuid
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["Store", "LocalStore", "FilesystemStore", "DBFSLocalStore", "HDFSStore", "hdfs_url"]

_CKPT = re.compile(r"epoch-(\d{6})\.ckpt$")


class Store:
    """Base class: path arithmetic and the run layout over five file operations."""

    def __init__(self, prefix_path: str, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.prefix_path = prefix_path.rstrip("/") or "/"
        self.keep = keep

    @staticmethod
    def create(path: str, **storage_options: Any) -> "Store":
        """The store for ``path`` (see the module doc for which one)."""
        if path.startswith("dbfs:/"):
            return LocalStore("/dbfs/" + path[len("dbfs:/"):].lstrip("/"))
        if path.startswith("file://"):
            return LocalStore(path[len("file://"):])
        if "://" not in path:
            return LocalStore(path)
        return FilesystemStore(path, **storage_options)

    # file operations, per implementation
    def write_bytes(self, path: str, data: bytes) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement write_bytes")

    def read_bytes(self, path: str) -> bytes:
        raise NotImplementedError(f"{type(self).__name__} does not implement read_bytes")

    def exists(self, path: str) -> bool:
        raise NotImplementedError(f"{type(self).__name__} does not implement exists")

    def listdir(self, path: str) -> List[str]:
        """Base names in the directory ``path``; [] if it does not exist."""
        raise NotImplementedError(f"{type(self).__name__} does not implement listdir")

    def remove(self, path: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement remove")

    # the run layout
    def join(self, *parts: str) -> str:
        return "/".join([self.prefix_path.rstrip("/")] + [p.strip("/") for p in parts])

    def run_path(self, run_id: str) -> str:
        return self.join("runs", run_id)

    def checkpoint_path(self, run_id: str, epoch: int) -> str:
        return self.join("runs", run_id, "checkpoints", f"epoch-{epoch:06d}.ckpt")

    def model_path(self, run_id: str) -> str:
        return self.join("runs", run_id, "model.bin")

    def checkpoint_epochs(self, run_id: str) -> List[int]:
        names = self.listdir(self.join("runs", run_id, "checkpoints"))
        return sorted(int(m.group(1)) for m in map(_CKPT.match, names) if m)

    def save_checkpoint(self, run_id: str, epoch: int, data: bytes,
                        history: Optional[Dict[str, List[float]]] = None) -> str:
        """Write the state after ``epoch``; drop all but the newest ``keep``."""
        path = self.checkpoint_path(run_id, epoch)
        self.write_bytes(path, data)
        if history is not None:
            self.write_bytes(self.join("runs", run_id, "history.json"),
                             json.dumps(history).encode())
        for old in self.checkpoint_epochs(run_id)[:-self.keep]:
            self.remove(self.checkpoint_path(run_id, old))
        return path

    def latest_checkpoint(self, run_id: str) -> Optional[Tuple[int, bytes]]:
        """(epoch, bytes) of the newest checkpoint of ``run_id``, or None."""
        epochs = self.checkpoint_epochs(run_id)
        if not epochs:
            return None
        return epochs[-1], self.read_bytes(self.checkpoint_path(run_id, epochs[-1]))

    def check_writable(self, run_id: str) -> None:
        """Write and remove a probe file where `run_id`'s checkpoints go, before training.

        Raises:
            ValueError: naming the store and the error, so no epoch is spent first.
        """
        probe = self.join(self.run_path(run_id), ".write-probe")
        try:
            self.write_bytes(probe, b"probe")
            self.remove(probe)
        except Exception as exc:
            raise ValueError(f"the store {self!r} cannot be written ({type(exc).__name__}: "
                             f"{exc}); pass store= a path the driver and every executor can "
                             "write") from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix_path!r})"


class LocalStore(Store):
    """A directory on a local (or FUSE-mounted shared) file system."""

    def __init__(self, prefix_path: str, keep: int = 2):
        super().__init__(os.path.abspath(os.path.expanduser(prefix_path)), keep)

    def write_bytes(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> List[str]:
        return sorted(os.listdir(path)) if os.path.isdir(path) else []

    def remove(self, path: str) -> None:
        if os.path.exists(path):
            os.remove(path)


class FilesystemStore(Store):
    """Any fsspec file system (``hdfs://``, ``s3://``, ``gs://``, ``abfs://``, ...) or a
    ``pyarrow.fs.FileSystem`` passed as ``filesystem`` (then ``prefix_path`` is a path on it)."""

    def __init__(self, prefix_path: str, filesystem: Any = None, keep: int = 2,
                 **storage_options: Any):
        super().__init__(prefix_path, keep)
        if filesystem is None:
            import fsspec

            filesystem, root = fsspec.core.url_to_fs(prefix_path, **storage_options)
            self._strip = prefix_path[: len(prefix_path) - len(root)] if \
                prefix_path.endswith(root) else ""
        else:
            self._strip = ""
        self.filesystem = filesystem
        self._arrow = type(filesystem).__module__.startswith("pyarrow")

    def _fs_path(self, path: str) -> str:
        if self._strip and path.startswith(self._strip):
            return path[len(self._strip):] or "/"
        return path

    def write_bytes(self, path: str, data: bytes) -> None:
        target = self._fs_path(path)
        parent = target.rsplit("/", 1)[0]
        tmp = f"{target}.tmp-{uuid.uuid4().hex}"
        if self._arrow:
            self.filesystem.create_dir(parent, recursive=True)
            with self.filesystem.open_output_stream(tmp) as f:
                f.write(data)
            self.filesystem.move(tmp, target)
        else:
            self.filesystem.makedirs(parent, exist_ok=True)
            with self.filesystem.open(tmp, "wb") as f:
                f.write(data)
            self.filesystem.mv(tmp, target)

    def read_bytes(self, path: str) -> bytes:
        target = self._fs_path(path)
        if self._arrow:
            with self.filesystem.open_input_stream(target) as f:
                return f.read()
        with self.filesystem.open(target, "rb") as f:
            return f.read()

    def exists(self, path: str) -> bool:
        target = self._fs_path(path)
        if self._arrow:
            import pyarrow.fs as pafs

            return self.filesystem.get_file_info(target).type != pafs.FileType.NotFound
        return self.filesystem.exists(target)

    def listdir(self, path: str) -> List[str]:
        target = self._fs_path(path)
        if not self.exists(path):
            return []
        if self._arrow:
            import pyarrow.fs as pafs

            infos = self.filesystem.get_file_info(pafs.FileSelector(target))
            return sorted(i.base_name for i in infos)
        return sorted(p.rstrip("/").rsplit("/", 1)[-1]
                      for p in self.filesystem.ls(target, detail=False))

    def remove(self, path: str) -> None:
        if not self.exists(path):
            return
        target = self._fs_path(path)
        if self._arrow:
            self.filesystem.delete_file(target)
        else:
            self.filesystem.rm(target)


class DBFSLocalStore(LocalStore):
    """Horovod's name for a store on Databricks' FUSE mount: ``dbfs:/x`` is ``/dbfs/x``,
    which every node sees; any other path is a local directory."""

    def __init__(self, prefix_path: str, keep: int = 2, **_ignored: Any):
        if prefix_path.startswith("dbfs:/"):
            prefix_path = "/dbfs/" + prefix_path[len("dbfs:/"):].lstrip("/")
        super().__init__(prefix_path, keep)


def hdfs_url(prefix_path: str, host: Optional[str] = None, port: Optional[int] = None) -> str:
    """``prefix_path`` as an ``hdfs://`` URL (a bare path goes to host:port, or to the
    cluster's default name node)."""
    if prefix_path.startswith("hdfs://"):
        return prefix_path
    if "://" in prefix_path:
        raise ValueError(f"HDFSStore takes an hdfs:// URL or a path, got {prefix_path!r}; "
                         "use Store.create() for other file systems")
    netloc = (host or "default") + (f":{int(port)}" if port else "")
    return f"hdfs://{netloc}/{prefix_path.lstrip('/')}"


class HDFSStore(FilesystemStore):
    """Horovod's name for a store on HDFS: a ``FilesystemStore`` over fsspec's ``hdfs://``
    (pyarrow's HadoopFileSystem: libhdfs and a JVM on every node)."""

    def __init__(self, prefix_path: str, host: Optional[str] = None, port: Optional[int] = None,
                 user: Optional[str] = None, kerb_ticket: Optional[str] = None, keep: int = 2,
                 **storage_options: Any):
        extra = {k: v for k, v in (("user", user), ("kerb_ticket", kerb_ticket)) if v is not None}
        super().__init__(hdfs_url(prefix_path, host, port), keep=keep, **extra,
                         **storage_options)
