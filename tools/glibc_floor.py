"""What the shared libraries of a wheel need from the system, and whether a manylinux tag allows it.

    python tools/glibc_floor.py WHEEL [--max 2.17]

Prints, for every ELF file in the wheel, the libraries it links (DT_NEEDED) and the newest
symbol version it needs of each; exits 1 when one needs a library outside the manylinux
allow-list (libc, libm, libpthread, libdl, librt and the dynamic loader: no libstdc++,
libgcc_s or libatomic), a GLIBC version newer than --max, or any GLIBCXX/CXXABI/GCC
version.  It reads the ELF files of any architecture, so it checks the cross-built aarch64
wheels, which auditwheel on an x86-64 host refuses to look at.
"""
from __future__ import annotations

import argparse
import io
import re
import sys
import zipfile

from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection

ALLOWED = re.compile(r"^(libc|libm|libpthread|libdl|librt)\.so\.\d+$|^ld-linux[-\w.]*\.so\.\d+$")


def _version(text: str) -> tuple:
    return tuple(int(x) for x in text.split("_", 1)[1].split("."))


def needs(data: bytes) -> dict:
    """{library: [symbol versions]} of one ELF file."""
    elf = ELFFile(io.BytesIO(data))
    out: dict = {}
    for section in elf.iter_sections():
        if isinstance(section, DynamicSection):
            for tag in section.iter_tags("DT_NEEDED"):
                out.setdefault(tag.needed, [])
        if isinstance(section, GNUVerNeedSection):
            for verneed, auxes in section.iter_versions():
                out.setdefault(verneed.name, []).extend(aux.name for aux in auxes)
    return out


def problems(wheel: str, floor: tuple) -> list:
    found = []
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            data = z.read(name) if name.endswith(".so") or ".so." in name else b""
            if not data.startswith(b"\x7fELF"):
                continue
            for lib, versions in needs(data).items():
                newest = max((v for v in versions if v.startswith("GLIBC_")), key=_version,
                             default="-")
                print(f"{name}: {lib} {newest}")
                if not ALLOWED.match(lib):
                    found.append(f"{name} links {lib}, which manylinux does not allow")
                for v in versions:
                    if v.startswith(("GLIBCXX_", "CXXABI_", "GCC_")):
                        found.append(f"{name} needs {v} of {lib}")
                    elif v.startswith("GLIBC_") and v != "GLIBC_PRIVATE" and _version(v) > floor:
                        found.append(f"{name} needs {v}, newer than glibc "
                                     f"{'.'.join(map(str, floor))}")
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel")
    p.add_argument("--max", default="2.17", help="the newest glibc the tag allows (2.17)")
    args = p.parse_args()
    found = problems(args.wheel, tuple(int(x) for x in args.max.split(".")))
    for line in found:
        print(f"glibc_floor: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
