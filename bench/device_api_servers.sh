#!/usr/bin/env bash
# bench_api_servers on a machine of more cores than this one: the device machine some sessions
# are lent (16 cores, Python 3.12 with CUDA torch, no package registry). Issue 33, item 4.
#
#   bench/device_api_servers.sh prepare   # here: the wheels and the model's text files, ignored
#   (device run, carry [".whl", ".device"]): bash bench/device_api_servers.sh run
#
# `prepare` downloads, for CPython 3.12 on x86-64, the runtime packages the device image lacks or
# has too old (its list: the device tool's KINDS.md), at the versions of this venv, into .whl/;
# and copies the default model's files but its weights into .device/cache (TOKENWIRE_CACHE
# there). The bench needs no weights: the engine that costs nothing serves it.
# `run` installs them, checks the imports and a smoke run, then measures N = 1, 2, 4 with the
# load split over 4 client processes; its output lands in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
    grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
    grep -qx "/.device/" .git/info/exclude || echo /.device/ >>.git/info/exclude
    packages=(fastapi starlette pydantic pydantic_core annotated-types typing-inspection
        annotated-doc anyio typing_extensions uvicorn httptools orjson minijinja llguidance
        transformers tokenizers huggingface_hub hf-xet httpx2 httpcore2 truststore httpx httpcore
        click typer kernels tomlkit regex opentelemetry-api)
    pinned=()
    for name in "${packages[@]}"; do
        pinned+=("$name==$(.venv/bin/python -m pip show "$name" | awk '/^Version:/{print $2}')")
    done
    platforms=()
    for tag in manylinux_2_31 manylinux_2_28 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
        platforms+=(--platform "${tag}_x86_64")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d .whl "${pinned[@]}"
    model=$(.venv/bin/python -c 'from tokenwire.assets import prepare; from tokenwire.settings import DEFAULT_MODEL; print(prepare(DEFAULT_MODEL))')
    mkdir -p ".device/cache/models/$(basename "$model")"
    find "$model" -maxdepth 1 -type f ! -name "*.safetensors" \
        -exec cp {} ".device/cache/models/$(basename "$model")/" \;
    du -sh .whl .device
    ;;
run)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site TOKENWIRE_CACHE=$PWD/.device/cache PYTHONUNBUFFERED=1
    nproc
    uptime
    PYTHONPATH=/tmp/site:src:. python3 -c "import tokenwire.api.app, tests.fast_app"
    timeout 90 python3 bench/bench_api_servers.py --smoke --counts 1 2 | tee "$OUT/smoke.log"
    timeout 400 python3 bench/bench_api_servers.py --counts 1 2 4 --rounds 3 --requests 24000 \
        --clients 64 --client-processes 4 | tee "$OUT/bench.log"
    uptime
    ;;
*)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
