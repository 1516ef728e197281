#!/usr/bin/env bash
# Create (or reuse) the MindFormers peer venv and print its python path on the last line.
#
#   bash tools/mindformers_env.sh            # -> /root/.cache/msllm/mf-venv/bin/python
#   MSLLM_MF_VENV=/some/dir bash tools/mindformers_env.sh
#
# The venv is separate from the main msllm environment on purpose: mindformers 1.9.0
# pins mindspore~=2.9.0, numpy<2 and transformers==4.57.1. torch is never installed here.
set -euo pipefail

VENV="${MSLLM_MF_VENV:-$HOME/.cache/msllm/mf-venv}"
PY_BASE="${MSLLM_MF_PYTHON:-python3}"
PINS=(
  "mindformers==1.9.0"
  "mindspore==2.9.0"
  "numpy<2"
  "transformers==4.57.1"
  "safetensors"
  "psutil"
)
STAMP="$VENV/.msllm-mf-stamp"
WANT="$(printf '%s\n' "${PINS[@]}")"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
  echo "mindformers_env: reusing $VENV" >&2
else
  echo "mindformers_env: creating $VENV" >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY_BASE" -m venv "$VENV"
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q "${PINS[@]}" >&2
  # Smoke-import: fail here rather than at first use.
  "$VENV/bin/python" - >&2 <<'EOF'
import mindspore, mindformers, numpy, transformers
from mindformers.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: F401
print("mindspore", mindspore.__version__, "mindformers", mindformers.__version__,
      "numpy", numpy.__version__, "transformers", transformers.__version__)
EOF
  printf '%s\n' "${PINS[@]}" > "$STAMP"
fi

echo "$VENV/bin/python"
