# prefixd — every target creates .venv and installs into it when needed (idempotent).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test soak bench bench-peers clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or run: make PYTHON=python3 ...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, exactly pinned, so pip takes the CPU build rather than resolving a CUDA one.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m prefixd.tools.demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not soak"

soak: $(STAMP)
	$(PY) -m pytest -q -m soak

# SGLang's RadixCache, the peer bench/core.py runs side by side (apart from .venv; see the file).
bench-peers: $(STAMP)
	$(PY) -m pip install -q --no-deps --target bench/out/sglang -r bench/peers/sglang-requirements.txt

bench: $(STAMP)
	$(PY) bench/core.py --workload gsp --json
	$(PY) bench/core.py --workload multiturn --json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
