"""Run a GPU script as one of several ranks that share this machine's one GPU.

    python -m collectives.launch -n 2 --hosts gpu-a,gpu-b tests/gpu/_shared_gpu.py SCRIPT ARGS...

NCCL refuses two ranks of one host on one GPU ("Duplicate GPU detected"), and
so do we.  Here each rank gets a host identity of its own: ours through the
launcher's --hosts (our shared-GPU check, local ranks and the CPU transport
see separate hosts), NCCL's through NCCL_HOSTID.  NCCL then connects the
ranks with its network transport over loopback sockets, as it would across
hosts: slow, but every collective runs between real ranks on a real GPU, so
a machine with one GPU tests what needs two.
"""
import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: _shared_gpu.py SCRIPT [ARGS...] (as a rank of collectives.launch --hosts)")
    if "HVS_HOST" not in os.environ:
        sys.exit("_shared_gpu.py runs as a rank of `python -m collectives.launch --hosts ...`")
    os.environ["NCCL_HOSTID"] = os.environ["HVS_HOST"]
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
