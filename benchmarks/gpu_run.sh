#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, run the GPU tests and the profile matrix.
#   device run, carry [".whl"]:  bash benchmarks/gpu_run.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export ANER_TOKENIZER_GGUF=$PWD/.whl/smollm2-tokenizer.gguf
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py "$@" 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 40
python3 benchmarks/gpu_profiles.py "$OUT/$(date +%Y-%m-%d)-h200-profiles.json" 2>&1 | tee "$OUT/gpu-profiles.log"
