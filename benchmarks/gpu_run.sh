#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, run the GPU tests and the profile matrix.
#   device run, carry [".whl"]:  bash benchmarks/gpu_run.sh
# Prepare .whl (an ignored folder) here first:
#   mkdir -p .whl && pip wheel --no-deps -w .whl llama-cpp-python==0.3.36   # CMAKE_ARGS as in the Makefile
#   pip download --no-deps -d .whl gguf==0.19.0 diskcache==5.6.3
#   .venv/bin/python -c "from aner.formats.gguf import read_gguf, write_gguf; from aner.embedded import \
#     ensure_default_model as m; g = read_gguf(m()); write_gguf('.whl/smollm2-tokenizer.gguf', \
#     [f for k, f in g.fields.items() if k.startswith('tokenizer.') or k == 'general.architecture'], [])"
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export ANER_TOKENIZER_GGUF=$PWD/.whl/smollm2-tokenizer.gguf
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py "$@" 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 40
python3 benchmarks/gpu_profiles.py "$OUT/$(date +%Y-%m-%d)-h200-profiles.json" 2>&1 | tee "$OUT/gpu-profiles.log"
