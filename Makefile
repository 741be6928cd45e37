# The two commands a new user needs: `make demo` and `make test`. Both install what they need
# (a .venv with the CPU build of torch, the package, redis-server if missing) and start their own
# Redis; nothing has to be running beforehand.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
DEMO_CONFIG ?= configs/demo.yaml
DEMO_MODEL ?= models/tiny
PYTEST_ARGS ?=
# The demo model: size and warm-start length tuned so that RL has room to improve (docs/BENCHMARKS.md).
TINY_MODEL_ARGS ?= --layers 2 --hidden 128 --sft-steps 100 --seed 0

.PHONY: install redis-server demo test test-unit bench clean

install: $(STAMP)

# torch first, pinned, so that resolving the other requirements never pulls a multi-GB CUDA build.
$(STAMP): setup.cfg setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing redis-server with apt-get"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else \
	    echo "redis-server is missing: run 'sudo apt-get install -y redis-server'" >&2; exit 1; \
	  fi; }

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(BIN)/python scripts/make_tiny_model.py --out $(DEMO_MODEL) $(TINY_MODEL_ARGS)

demo: install redis-server $(DEMO_MODEL)/config.json
	rm -rf runs/demo
	$(BIN)/rollctl run --config $(DEMO_CONFIG)

test: install redis-server
	$(BIN)/python -m pytest tests -q $(PYTEST_ARGS)

test-unit: install
	$(BIN)/python -m pytest tests/unit -q $(PYTEST_ARGS)

# Benchmarks print one JSON line each; docs/BENCHMARKS.md records them with the machine.
bench: install redis-server
	$(BIN)/python scripts/bench_async.py --steps 12

clean:
	rm -rf runs models $(VENV) *.egg-info
