#!/usr/bin/env bash
# What a lent GPU machine needs to run conveyor's CUDA tests and benchmarks, prepared here (that machine
# reaches no package index, runs Python 3.12, and takes at most 64 MiB of the checkout a call):
#   .whl/  Python 3.12 wheels of the server extra and gguf that its image lacks
#   .gpu/  Qwen2.5's tokenizer, for `python -m bench cuda --shape qwen2.5-0.5b` (from a Qwen GGUF file, if given)
#   .q1/ .q2/  the bundled model, xz-compressed, in two parts (one call carries each)
# Usage: scripts/gpu_prepare.sh [QWEN_GGUF]; then scripts/gpu_run.sh says how to run it there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
for d in .whl .gpu .q1 .q2; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
mkdir -p .whl .gpu .q1 .q2
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pins=$("$PY" -m pip list --format=freeze 2>/dev/null | grep -iE '^(gguf|fastapi|starlette|uvicorn|pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|python[-_]multipart|swagger[-_]ui[-_]bundle|jsonschema|jsonschema[-_]specifications|referencing|rpds[-_]py|opentelemetry[-_]api)==')
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl $pins
if [ $# -ge 1 ]; then
    "$PY" - "$1" <<'PYEOF'
import sys, pathlib
from transformers import AutoTokenizer
path = pathlib.Path(sys.argv[1])
AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(".gpu/qwen-tok")
PYEOF
    tar czf .gpu/qwen-tok.tgz -C .gpu qwen-tok && rm -rf .gpu/qwen-tok
fi
model=$("$PY" -c "from conveyor.model.checkpoint import resolve_model_path; print(resolve_model_path(None))")
xz -T2 -6 -c "$model" > /tmp/conveyor-bundled.xz
size=$(stat -c %s /tmp/conveyor-bundled.xz)
head -c $((size / 2)) /tmp/conveyor-bundled.xz > .q1/bundled.xz.0
tail -c +$((size / 2 + 1)) /tmp/conveyor-bundled.xz > .q2/bundled.xz.1
rm /tmp/conveyor-bundled.xz
du -sh .whl .gpu .q1 .q2
