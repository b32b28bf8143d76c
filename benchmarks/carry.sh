#!/usr/bin/env bash
# What the GPU machine needs beside the tree (it has torch, transformers and peft, and no network):
# the wheels `gpu_run.sh` installs and the files it reads, in .whl (an ignored folder, carried with
# the tree). Run here, at the repository's root, after `make setup`:
#
#   bash benchmarks/carry.sh [COMMIT ...]    each COMMIT's src/ and benchmarks/throughput.py go to
#                                            .whl/COMMIT: an earlier tree for `gpu_run.sh ab`
#                                            (OLD=.whl/COMMIT)
#
#   llama-cpp-python   built from source with the Makefile's portable flags (a few minutes, once:
#                      pip caches the wheel)
#   gguf, diskcache    as the project pins them
#   bitsandbytes       the peer's, trimmed to its CPU and CUDA 13.0 libraries (43 MB -> 3.6 MB)
#   cudnn-frontend     for attention_kernel="cudnn", built for the machine's Python 3.12
#   smollm2-tokenizer.gguf   the embedded model's tokenizer fields alone (ANER_TOKENIZER_GGUF)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
test -x $PY || { echo "run make setup first" >&2; exit 1; }
CMAKE_ARGS=$(sed -n 's/^export CMAKE_ARGS ?= //p' Makefile)
export CMAKE_ARGS
mkdir -p .whl
$PY -m pip wheel -q --no-deps -w .whl llama-cpp-python==0.3.36
$PY -m pip download -q --no-deps -d .whl gguf==0.19.0 diskcache==5.6.3 bitsandbytes==0.50.2
$PY -m pip download -q --no-deps -d .whl --only-binary=:all: --python-version 3.12 nvidia-cudnn-frontend==1.14.0
$PY - <<'EOF'
import base64, hashlib, pathlib, re, zipfile
wheel = next(pathlib.Path(".whl").glob("bitsandbytes-*.whl"))
keep = re.compile(r"libbitsandbytes_(cpu|cuda130)\.so$")
with zipfile.ZipFile(wheel) as z:
    files = {n: z.read(n) for n in z.namelist() if not n.endswith(".so") or keep.search(n)}
record = next(n for n in files if n.endswith(".dist-info/RECORD"))
lines = []
for name, data in files.items():
    if name != record:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{name},sha256={digest},{len(data)}")
files[record] = ("\n".join(lines + [f"{record},,"]) + "\n").encode()
tmp = wheel.with_suffix(".tmp")
with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
    for name, data in files.items():
        z.writestr(name, data)
tmp.replace(wheel)
print(f"{wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB")
EOF
PYTHONPATH=src $PY -c "
from aner.embedded import ensure_default_model
from aner.formats.gguf import read_gguf, write_gguf
g = read_gguf(ensure_default_model())
write_gguf('.whl/smollm2-tokenizer.gguf',
           [f for k, f in g.fields.items() if k.startswith('tokenizer.') or k == 'general.architecture'], [])"
for commit in "$@"; do
  rm -rf ".whl/$commit" && mkdir -p ".whl/$commit"
  git archive "$commit" src benchmarks/throughput.py | tar -x -C ".whl/$commit"
done
ls -l .whl
