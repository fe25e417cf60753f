#!/usr/bin/env bash
# On the GPU machine (no package registry there): install the wheels scripts/gpu_prepare.sh
# put in .whl/ if the server's imports are missing, then scripts/gpu_weight_sync.py once per
# mode (BACKEND:DEVICE): by default over NCCL, then gloo, each against a server on CUDA.
# Exits 1 if any row of any mode failed. With $OUT set (the device tool's folder), each mode's
# server log, trainer logs and summary.json land in $OUT/BACKEND-DEVICE/.
#
#   scripts/gpu_weight_sync.sh                       # MODES="nccl:cuda gloo:cuda"
#   MODES=nccl:cuda ROWS=base,sender scripts/gpu_weight_sync.sh
#   MODES=gloo:cpu scripts/gpu_weight_sync.sh        # without a GPU (PYTHON=.venv/bin/python)
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
MODES=${MODES:-nccl:cuda gloo:cuda}
ROWS=${ROWS:-base,plain,sglang,sender,missent}
MODE_TIMEOUT_S=${MODE_TIMEOUT_S:-240}

if ! "$PYTHON" -c "import fastapi, uvicorn, httptools, orjson, minijinja, pydantic" 2>/dev/null
then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "tokenwire's imports are missing and there is no .whl/: run scripts/gpu_prepare.sh" \
      "on a machine with PyPI and carry .whl" >&2
    exit 2
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi

status=0
for mode in $MODES; do
  backend=${mode%%:*}
  device=${mode##*:}
  out=()
  [ -n "${OUT:-}" ] && out=(--out "$OUT/$backend-$device")
  echo "#### $backend, server on $device"
  timeout --kill-after=20 "$MODE_TIMEOUT_S" "$PYTHON" scripts/gpu_weight_sync.py \
    --backend "$backend" --device "$device" --rows "$ROWS" "${out[@]}"
  code=$?
  [ "$code" -eq 124 ] && echo "#### $backend-$device: stopped after $MODE_TIMEOUT_S s"
  [ "$code" -ne 0 ] && status=1
done
echo "#### gpu_weight_sync.sh: exit $status"
exit "$status"
