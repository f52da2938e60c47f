"""The Horovod core the framework adapters share, as Horovod's own ``horovod/common``:

- ``basics``: the adapter state (`HorovodState`: init, rank, size, the engine, shutdown)
  and the framework-free build queries;
- ``process_sets``: `ProcessSet`, the table of a state's sets, a set's view for an op;
- ``elastic``: `State`, `ObjectState`, `run` and the world an elastic attempt sees.

`horovod_spark.torch`, `.tensorflow` and `.keras` build on these; nothing here imports a
framework.
"""
