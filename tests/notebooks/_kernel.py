"""A Jupyter kernel for the running interpreter, and a notebook executor over it.

The kernelspec is written to a private directory put first on JUPYTER_PATH, so
the notebooks run in `sys.executable` (whatever the machine's default `python3`
kernel is) with this checkout importable, in a scratch working directory.
"""
from __future__ import annotations

import os
import sys

import nbformat

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOKS = os.path.join(REPO, "notebooks")
KERNEL = "horovod-spark-tests"


def install_kernel(root: str) -> str:
    """Write a kernelspec running sys.executable under root; returns the JUPYTER_PATH entry."""
    from ipykernel.kernelspec import write_kernel_spec

    share = os.path.join(root, "share", "jupyter")
    spec_dir = os.path.join(share, "kernels", KERNEL)
    if os.path.exists(os.path.join(spec_dir, "kernel.json")):
        return share
    write_kernel_spec(spec_dir,
                      overrides={"display_name": f"Python ({sys.executable})"})
    return share


def run_notebook(path: str, workdir: str, cell_timeout: int = 600):
    """Execute every cell of the notebook at path in the test kernel; returns the notebook."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, kernel_name=KERNEL, timeout=cell_timeout, allow_errors=False,
                   resources={"metadata": {"path": workdir}}).execute()
    return nb


def outputs(nb) -> list:
    """(cell index, output) for every output of every code cell."""
    return [(i, out) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            for out in cell.get("outputs", [])]


def text_of(nb) -> str:
    """Every stream and text/plain output, joined."""
    parts = []
    for _, out in outputs(nb):
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
    return "\n".join(parts)


def images_of(nb) -> int:
    return sum("image/png" in out.get("data", {}) for _, out in outputs(nb))
