# The two commands of the README: `make demo` and `make test`. Both set everything up first.
VENV   := .venv
PY     := $(VENV)/bin/python
export ANER_HOME ?= $(HOME)/.cache/aner
# A portable llama.cpp build: the same wheel runs on every x86-64 machine with AVX2.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON

.PHONY: setup model demo test clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of PyTorch, pinned: a looser requirement would fetch a multi-GB CUDA build.
	# Triton for its CPU interpreter, which runs the kernels' tests here; 3.9's interpreter gives a
	# comparison of two scalars their integer type, and a load masked by it then fails.
	$(PY) -m pip install --quiet torch==2.13.0 triton==3.8.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

setup: $(VENV)/.installed

# The embedded default model: SmolLM2-135M-Instruct as an F16 GGUF under $ANER_HOME (done once).
model: setup
	$(PY) -m aner.embedded

demo: model
	$(PY) examples/llm_pretrained_fine_tuning.py

# The GPU kernels' tests skip in the first run on a machine without CUDA; the second runs them on
# the CPU under Triton's interpreter (smaller shapes, the same references), then compiles every
# kernel variant they launched for a Hopper GPU, as a GPU launches it, and the Gluon kernels at their
# tests' launches (benchmarks/compile_kernels.py).
test: model
	$(PY) -m pytest -q
	$(PY) benchmarks/compile_kernels.py

clean:
	rm -rf $(VENV) out
