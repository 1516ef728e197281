#!/usr/bin/env bash
# Dry-run compile of a config's parallel layout for Ascend (MindSpore msrun --sim_level): one
# simulated rank's graph is built and compiled, no device executes anything.
# NOT EXECUTED by this project: it needs CANN (the Ascend toolkit), which was not available here.
#
#   bash tools/dryrun_ascend.sh CONFIG DEVICES [--set SECTION.KEY=VALUE ...]
#   SIM_LEVEL=1 SIM_RANK=0 bash tools/dryrun_ascend.sh configs/llama3_8b.yaml 64 --set parallel.tp=8 ...
#
# SIM_LEVEL 0 compiles only; 1 also reports the memory the rank would use. Check the layout first:
#   msllm plan --config CONFIG --devices DEVICES --check
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,10p' "$0"; exit 2
fi
config=$1; devices=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd)
msrun --worker_num="$devices" --local_worker_num="$devices" \
      --sim_level="${SIM_LEVEL:-1}" --sim_rank_id="${SIM_RANK:-0}" \
      --log_dir="${LOG_DIR:-dryrun_logs}" --join=True \
      "$here/dryrun_ascend.py" --config "$config" "$@"
