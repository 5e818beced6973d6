#!/usr/bin/env bash
# The demo, on a fresh machine: a virtual environment with planaria and the CPU build of torch,
# then `planaria run examples/local.yaml`: a small GPT trained with DDP over gloo by 2 nodes x 2
# workers on this machine, through one injected worker kill and one node kill; it ends with
# the path of the run's report (report.html: the job over time, every fault and recovery).
# Extra arguments go to `planaria run` (e.g. --set job.nodes=3).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${PLANARIA_DEMO_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[report]" "torch==2.13.0" numpy
export PATH="$PWD/$venv/bin:$PATH"
exec planaria run examples/local.yaml "$@"
