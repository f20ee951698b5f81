# `make demo` and `make test` each set up their own virtual environment on first use.
# On a CPU machine torch is installed first, on its own, so that nothing pulls CUDA wheels:
#   - this workplace's pip finds a local CPU build of torch==2.13.0;
#   - elsewhere, pass the CPU index: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.exgrpo-installed

.PHONY: install demo test slow_test quality clean

$(STAMP): pyproject.toml requirements/cpu.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -r requirements/cpu.lock
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/exgrpo demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

slow_test: $(STAMP)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
