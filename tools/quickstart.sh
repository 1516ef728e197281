#!/usr/bin/env bash
# README command 1: set up, then train the tiny default Llama on CPU in graph mode and sample from it.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$(bash "$repo/tools/setup_env.sh")"
cd "$repo"
"$bin/msllm" train --config configs/tiny.yaml "$@"
