"""Debian roots made with debootstrap, to run a wheel on another glibc or architecture.

A *root* is a minimal Debian system in a directory (`debian_root`): Debian 11 for the oldest
glibc this machine can fetch (2.31; older releases are off deb.debian.org), Debian 12 for
arm64, whose binaries run through qemu-user (binfmt_misc, `ensure_qemu`).  Roots are cached
in ROOTS (only read by the tests, made again when their marker is missing); `run_in_root`
runs a command in one, with its own /proc and a private /dev/shm, in a mount namespace that
ends with it.  Every helper says why it cannot run, for the test to skip with.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional, Sequence

ROOTS = "/var/tmp/hvs-test-roots"
MIRROR = "http://deb.debian.org/debian"


def unavailable() -> Optional[str]:
    if os.geteuid() != 0:
        return "debootstrap, chroot and mount need root"
    for tool in ("debootstrap", "unshare", "chroot"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install debootstrap)"
    return None


def debian_root(suite: str, arch: str, packages: Sequence[str]) -> str:
    """The root of Debian `suite` for `arch` with `packages`, made once and cached."""
    root = os.path.join(ROOTS, f"{suite}-{arch}")
    marker = os.path.join(root, ".hvs-complete")
    if os.path.exists(marker):
        return root
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    done = subprocess.run(["debootstrap", f"--arch={arch}", "--variant=minbase",
                           "--include=" + ",".join(packages), suite, root, MIRROR],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise RuntimeError(f"debootstrap {suite} {arch} failed:\n{done.stdout[-2000:]}"
                           f"{done.stderr[-2000:]}")
    open(marker, "w").close()
    return root


def ensure_qemu(arch: str = "aarch64") -> Optional[str]:
    """Why `arch` binaries cannot run here through qemu-user, or None once they can."""
    entry = f"/proc/sys/fs/binfmt_misc/qemu-{arch}"
    if not os.path.exists("/proc/sys/fs/binfmt_misc/register"):
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", "/proc/sys/fs/binfmt_misc"],
                       capture_output=True)
    if not os.path.exists(entry) and shutil.which("update-binfmts"):
        subprocess.run(["update-binfmts", "--enable", f"qemu-{arch}"], capture_output=True)
    if not os.path.exists(entry):
        return (f"no binfmt_misc entry for qemu-{arch}: apt-get install qemu-user-static "
                f"binfmt-support")
    with open(entry) as f:
        state = f.read()
    if not state.startswith("enabled") or "F" not in state.split("flags:")[-1].split()[0]:
        return f"qemu-{arch} is registered without the F flag, so it cannot run in a chroot"
    return None


def run_in_root(root: str, command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`command` (sh) in `root`, with /proc and a private /dev/shm mounted for it alone."""
    script = (f"mount -t proc proc {root}/proc && mkdir -p {root}/dev/shm && "
              f"mount -t tmpfs tmpfs {root}/dev/shm && exec chroot {root} sh -c \"$0\"")
    return subprocess.run(["unshare", "--mount", "--fork", "sh", "-c", script, command],
                          capture_output=True, text=True, timeout=timeout)


def unpack_wheel(wheel: str, root: str, where: str = "/opt/hvs") -> str:
    """The wheel's files under `where` in `root` (its site directory there)."""
    import zipfile

    target = root + where
    shutil.rmtree(target, ignore_errors=True)
    zipfile.ZipFile(wheel).extractall(target)
    for dirpath, _, files in os.walk(target):  # zipfile drops the executable bits
        for name in files:
            if name.endswith(".so"):
                os.chmod(os.path.join(dirpath, name), 0o755)
    return where
