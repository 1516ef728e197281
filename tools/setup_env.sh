#!/usr/bin/env bash
# Create (once) and refresh (when setup.cfg changes) the msllm virtualenv; print its bin dir.
# Idempotent: a second run reuses the environment and installs nothing.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MSLLM_VENV:-$HOME/.cache/msllm/venv-py311}"

py=""
for cand in python3.11 python3 python; do
  if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    py="$cand"; break
  fi
done
[ -n "$py" ] || { echo "setup: msllm needs Python 3.11 (mindspore 2.10 wheels); none found on PATH" >&2; exit 2; }

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv" >&2
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
fi
stamp="$venv/.msllm-stamp"
want="$(cat "$repo/setup.cfg" "$repo/pyproject.toml" | sha1sum | cut -c1-16) $repo"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing msllm and dependencies (first time: mindspore ~800 MB download)" >&2
  # a clean clone (a new $repo) re-points the editable install; pip itself was upgraded with the venv
  "$venv/bin/python" -m pip install --quiet -e "$repo[test]" >&2
  echo "$want" > "$stamp"
fi
echo "$venv/bin"
