# Two entry points: `make demo` and `make test`. Both create .venv and install poslsh into it.
VENV    ?= .venv
PYTHON  ?= python3
# The CPU build of torch; on this kind of machine pip takes it from a local file.
TORCH   ?= torch==2.13.0
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.poslsh-installed

# The Hugging Face integration's tested range of transformers: the newest release of the [hf] extra's range
# runs in `make test`; its floor runs in a throwaway environment (`make test-hf-range`, also in CI).
HF_FLOOR ?= 5.24.0
HF_VENV  ?= .venv-hf-floor

.PHONY: setup demo test test-hf-range test-hf-next test-slow bench gpu-bundle clean

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

test-hf-range:
	rm -rf $(HF_VENV)
	$(PYTHON) -m venv $(HF_VENV)
	$(HF_VENV)/bin/python -m pip install -q "$(TORCH)" "transformers==$(HF_FLOOR)" safetensors pytest numpy
	cd $(CURDIR) && PYTHONPATH=$(CURDIR) $(HF_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/integrations
	rm -rf $(HF_VENV)

# Not in CI: the integration tests on the newest transformers on the package index, inside or outside the range
# (what the next release breaks, before a user finds it).
test-hf-next:
	rm -rf $(HF_VENV)-next
	$(PYTHON) -m venv $(HF_VENV)-next
	$(HF_VENV)-next/bin/python -m pip install -q "$(TORCH)" -U transformers safetensors pytest numpy
	PYTHONPATH=$(CURDIR) $(HF_VENV)-next/bin/python -m pytest -q -p no:cacheprovider tests/integrations
	rm -rf $(HF_VENV)-next

test-slow: setup
	$(PY) -m pytest -q -m slow

bench: setup
	$(PY) benchmarks/bench_cpu.py

# The wheels the GPU machine lacks (transformers of the tested range), into .gpu/ for the device call
# to carry (docs/gpu.md); needs the package index, not the venv.
gpu-bundle:
	PYTHON=$(PYTHON) bash benchmarks/gpu_bundle.sh

clean:
	rm -rf $(VENV) $(HF_VENV) $(HF_VENV)-next build *.egg-info
