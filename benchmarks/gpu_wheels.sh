#!/usr/bin/env bash
# Makes .whl/ (in the repository root) for benchmarks/gpu.sh: the Python 3.12 manylinux x86_64
# wheels of what a GPU machine without an index lacks, plus planaria's own (core and
# planaria-nvidia). Run it on a machine that reaches a package index; it needs only pip.
#
#   benchmarks/gpu_wheels.sh            # writes .whl/ (emptied first)
#   PYTHON=python3.11 benchmarks/gpu_wheels.sh
#
# The GPU machine is assumed to have torch (with typing-extensions, filelock, jinja2 ...),
# pytest, hypothesis, aiohttp (with multidict, yarl, ...), pluggy, pyyaml, rich, numpy,
# nvidia-ml-py and matplotlib. The rest of what the core's and planaria-nvidia's pyproject files
# require is listed below, at versions that satisfy them (and each other's requirements);
# typing-extensions is included because pydantic 2.14 needs >= 4.16, newer than some torch
# images carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT_DIR=.whl
WHEELS=(
  # the core's requirements the GPU machine lacks
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
  structlog==26.1.0
  typer==0.29.2 shellingham==1.5.4 annotated-doc==0.0.7
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
  xxhash==4.1.0 py-spy==0.4.3 setproctitle==1.3.8 prometheus-client==0.26.0
)
rm -rf "$OUT_DIR" && mkdir -p "$OUT_DIR"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d "$OUT_DIR" "${WHEELS[@]}"
# planaria's own: pure Python, built from a copy of this checkout (no build/ left here).
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
mkdir -p "$src/plugins"
cp -r pyproject.toml README.md core "$src/"
cp -r plugins/nvidia "$src/plugins/"
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT_DIR" "$src" "$src/plugins/nvidia"
# Every wheel must install on CPython 3.12, x86_64 Linux.
bad=0
for wheel in "$OUT_DIR"/*.whl; do
  tags=$(basename "$wheel" .whl | rev | cut -d- -f1-3 | rev)  # python-abi-platform
  case "$tags" in
    py3-none-any | cp312-cp312-*manylinux*x86_64* | cp3*-abi3-*manylinux*x86_64* | \
      py2.py3-none-any | py3-none-*manylinux*x86_64* | py2.py3-none-*manylinux*x86_64*) ;;
    *) echo "not for CPython 3.12 on x86_64 Linux: $(basename "$wheel")" >&2; bad=1 ;;
  esac
done
[ "$bad" = 0 ] || exit 1
# ... and installs there: pip checks each tag against a CPython 3.12 x86_64 Linux target.
check=$(mktemp -d)
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$check" \
  --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
  --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  --platform any "$OUT_DIR"/*.whl
rm -rf "$check"
ls -1 "$OUT_DIR"
du -sh "$OUT_DIR"
