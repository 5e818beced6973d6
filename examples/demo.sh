#!/usr/bin/env bash
# The demo, on a fresh machine: a virtual environment with planaria and the CPU build of torch,
# then `planaria run examples/local.yaml`: a small GPT trained with DDP over gloo by 2 nodes x 2
# workers on this machine, through one injected worker kill and one node kill; it ends with
# the path of the run's report (report.html: the job over time, every fault and recovery).
# Extra arguments go to `planaria run` (e.g. --set job.nodes=3). Afterwards
# `. .venv/bin/activate` gives a shell in which every command of the README runs.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${PLANARIA_DEMO_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# The core with its report, and every plugin of this checkout that runs without a system of its
# own to talk to, so that each command of the README runs in this environment: custom_script
# (`planaria check -c examples/check.yaml`), fsspec (file:// and memory:// storage), slurm
# (`planaria submit --dry-run` needs no cluster) and kubernetes (`planaria kubernetes
# manifest`). Not ray (a Ray of the cluster's own version), nvidia or ascend (their chips).
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[report]" \
    -e plugins/custom_script -e plugins/fsspec -e plugins/slurm -e plugins/kubernetes \
    "torch==2.13.0" numpy
export PATH="$PWD/$venv/bin:$PATH"
exec planaria run examples/local.yaml "$@"
