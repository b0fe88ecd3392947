# Two entry points: `make demo` and `make test`. Both create .venv and install poslsh into it.
VENV    ?= .venv
PYTHON  ?= python3
# The CPU build of torch; on this kind of machine pip takes it from a local file.
TORCH   ?= torch==2.13.0
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.poslsh-installed

.PHONY: setup demo test test-slow bench gpu-bundle clean

$(STAMP): pyproject.toml paper/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[all]" -e ./paper
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/poslsh demo
	@echo ""
	@echo "The poslsh command is installed in $(VENV): run it as $(VENV)/bin/poslsh, or put it on"
	@echo "your PATH for this shell with: source $(VENV)/bin/activate   (then: poslsh --help)"

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

bench: setup
	$(PY) benchmarks/bench_cpu.py

# The wheels the GPU machine lacks (transformers of the tested range), into .gpu/ for the device call
# to carry (docs/gpu.md); needs the package index, not the venv.
gpu-bundle:
	PYTHON=$(PYTHON) bash benchmarks/gpu_bundle.sh

clean:
	rm -rf $(VENV) build *.egg-info
