#!/usr/bin/env bash
# One run of planaria's GPU checks and benchmarks on a GPU machine without an index, in about
# 6 to 7 minutes on one H200. Parts, each with its own timeout (and all within GPU_SH_BUDGET s):
#
#   install     the wheels of .whl/ (benchmarks/gpu_wheels.sh makes it) into /tmp/site
#   nvidia-smi  the GPUs and the driver
#   check       planaria check -c benchmarks/gpu.yaml (host and nvidia health checks)
#   preflight   planaria check --preflight (the nvidia node benchmark, two local nodes), then
#               every node's figures
#   pytest      pytest -m gpu on the core's tests and planaria-nvidia's
#   checkpoint  benchmarks/checkpoint.py --device cuda (4 GiB of CUDA state)
#   recovery    benchmarks/recovery.py --device cuda (a kill during a save, between saves)
#
# Each part's output goes to $OUT/<part>.log ($OUT, else a new temporary directory), the table
# of PASS/FAIL per part to $OUT/summary.txt and stdout: 8 files at most. A part fails when it
# exits non-zero or prints a FAIL line (a missed target); the script goes on to the next part
# and exits 1 if any failed.
#
#   benchmarks/gpu_wheels.sh           # once, on a machine with an index: makes .whl/
#   OUT=/some/dir benchmarks/gpu.sh    # on the GPU machine, from a checkout holding .whl/
#
# .whl/ is git-ignored (about 12 MB): whatever copies the checkout to the GPU machine must copy
# it too.
#   GPU_SH_DEVICE=cpu benchmarks/gpu.sh   # dry run without a GPU: the same parts, on CPU
#
# GPU_SH_DEVICE=cpu runs the benchmarks' --cpu-dry-run paths (the figures mean nothing), skips
# nvidia-smi, and only checks that the wheels install for CPython 3.12 (pip's --python-version)
# without using them: the interpreter there has its own packages; PYTHON (default python3) is the interpreter; GPU_SH_BUDGET (default 400)
# the seconds all parts may take together; GPU_SH_SITE (default /tmp/site) where wheels go.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
DEVICE=${GPU_SH_DEVICE:-cuda}
BUDGET=${GPU_SH_BUDGET:-400}
SITE=${GPU_SH_SITE:-/tmp/site}
OUT=${OUT:-$(mktemp -d -t planaria-gpu-XXXXXX)}
mkdir -p "$OUT"
START=$SECONDS
PARTS=()
declare -A STATUS SECS

case "$DEVICE" in
  cuda) DRY=() ;;
  cpu) DRY=(--cpu-dry-run) ;;
  *) echo "GPU_SH_DEVICE must be cuda or cpu, not '$DEVICE'" >&2; exit 2 ;;
esac

# run PART MAX_SECONDS COMMAND...: the command under `timeout`, its output in $OUT/PART.log.
run() {
  local part=$1 max=$2
  shift 2
  PARTS+=("$part")
  local left=$((BUDGET - (SECONDS - START)))
  local limit=$((max < left ? max : left))
  if [ "$limit" -lt 5 ]; then
    STATUS[$part]="SKIP (no time left of ${BUDGET}s)"
    SECS[$part]=0
    echo "== $part: skipped, no time left" | tee "$OUT/$part.log"
    return
  fi
  echo "== $part (at most ${limit}s): $*"
  local began=$SECONDS
  { echo "\$ $*"; echo; } >"$OUT/$part.log"
  if declare -F "$1" >/dev/null; then  # a function of this script: timeout needs a program
    timeout -k 10 "$limit" bash -c "$*" >>"$OUT/$part.log" 2>&1
  else
    timeout -k 10 "$limit" "$@" >>"$OUT/$part.log" 2>&1
  fi
  local rc=$?
  SECS[$part]=$((SECONDS - began))
  local missed
  missed=$(grep -c -E '(^|[[:space:]])FAIL([[:space:]]|$)' "$OUT/$part.log")
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    STATUS[$part]="FAIL (timed out after ${limit}s)"
  elif [ "$rc" != 0 ]; then
    STATUS[$part]="FAIL (exit $rc)"
  elif [ "$missed" != 0 ]; then
    STATUS[$part]="FAIL ($missed target(s) missed)"
  else
    STATUS[$part]="PASS"
  fi
  echo "   ${STATUS[$part]} in ${SECS[$part]}s; last lines of $OUT/$part.log:"
  tail -n 4 "$OUT/$part.log" | sed 's/^/   | /'
}

install_wheels() {
  shopt -s nullglob
  local wheels=(.whl/*.whl)
  if [ ${#wheels[@]} = 0 ]; then
    echo "no wheels in $ROOT/.whl: run benchmarks/gpu_wheels.sh on a machine with an index"
    return 1
  fi
  if [ "$DEVICE" = cpu ]; then  # check that they install for CPython 3.12, use none of them
    local scratch
    scratch=$(mktemp -d)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$scratch" --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
      "${wheels[@]}" || { rm -rf "$scratch"; return 1; }
    echo "the ${#wheels[@]} wheels install for CPython 3.12: $(ls "$scratch" | wc -l) entries"
    rm -rf "$scratch"
  else
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${wheels[@]}" || return 1
  fi
  # Every import the parts need, from this checkout's code and the installed wheels.
  "$PYTHON" -c 'import pydantic, structlog, typer, cryptography, xxhash, prometheus_client
import torch, planaria.cli, planaria_nvidia.plugin, planaria_nvidia.benchmark
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("planaria from", planaria.__file__)'
}

# pytest -m gpu where tests carry the mark: the core's (tests/) and planaria-nvidia's.
gpu_tests() {
  local rc=0 found
  found=$(grep -l -E 'mark\.gpu' tests/*.py 2>/dev/null)
  if [ -n "$found" ]; then
    # shellcheck disable=SC2086
    "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider $found || rc=1
  else
    echo "tests/: no test marked gpu"
  fi
  found=$(cd plugins/nvidia && grep -l -E 'mark\.gpu' tests/*.py 2>/dev/null)
  if [ -n "$found" ]; then
    # shellcheck disable=SC2086
    (cd plugins/nvidia && "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider $found) || rc=1
  else
    echo "plugins/nvidia/tests: no test marked gpu"
  fi
  return $rc
}

# planaria check --preflight in a scratch directory (its run directory goes there), then every
# node's figures as the benchmark reported them (TFLOP/s, GB/s: the summary shows seconds).
preflight() {
  local dir rc
  dir=$(mktemp -d)
  (cd "$dir" && "$PYTHON" -m planaria check -c "$ROOT/benchmarks/gpu.yaml" --preflight)
  rc=$?
  "$PYTHON" - "$dir" <<'PY'
import json, pathlib, sys
for path in pathlib.Path(sys.argv[1]).glob("planaria-runs/*/events.jsonl"):
    for line in path.read_text().splitlines():
        event = json.loads(line)
        for group in (event.get("data") or {}).get("groups") or []:
            for node, result in sorted(group.get("results", {}).items()):
                print(f"{group['group']} {node}: {result['status']} {result.get('error', '')}")
                for key, value in {**result["measures"], **result["info"]}.items():
                    print(f"    {key:<28} {value}")
PY
  rm -rf "$dir"
  return $rc
}

# This checkout's code first; the wheels' dist-info supplies the entry points.
if [ "$DEVICE" = cpu ]; then
  export PYTHONPATH="$ROOT/core:$ROOT/plugins/nvidia/src${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$ROOT/core:$ROOT/plugins/nvidia/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHON DEVICE SITE
export ROOT
export -f install_wheels gpu_tests preflight
echo "planaria GPU run: device $DEVICE, logs in $OUT, budget ${BUDGET}s"

run install 90 install_wheels
if [ "$DEVICE" = cuda ]; then
  run nvidia-smi 20 nvidia-smi
fi
run check 45 "$PYTHON" -m planaria check -c benchmarks/gpu.yaml
run preflight 90 preflight
run pytest 75 gpu_tests
run checkpoint 130 "$PYTHON" benchmarks/checkpoint.py --device cuda "${DRY[@]}" --runs 2 \
  --steps 5
run recovery 230 "$PYTHON" benchmarks/recovery.py --device cuda "${DRY[@]}" --trials 1 \
  --steps 20 --kill-at 10

failed=0
for part in "${PARTS[@]}"; do
  [ "${STATUS[$part]}" = PASS ] || failed=1
done
{
  printf '%-12s %-6s %s\n' part secs status
  for part in "${PARTS[@]}"; do
    printf '%-12s %-6s %s\n' "$part" "${SECS[$part]}" "${STATUS[$part]}"
  done
  echo "device $DEVICE; total $((SECONDS - START))s; logs in $OUT"
} | tee "$OUT/summary.txt"
exit $failed
