#!/usr/bin/env bash
# README command 2: set up, then run the test suite. .ci/run calls exactly this.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$(bash "$repo/tools/setup_env.sh")"
cd "$repo"
"$bin/python" -m pytest -q "$@"
