"""A small Llama with seeded random weights and SmolLM2's tokenizer, for vLLM's tensor and
pipeline parallelism on a CPU host.

    model_dir = build(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4)

SmolLM2-135M has 3 KV heads, so no tensor-parallel size above 1 divides them; this model has
``num_kv_heads`` of them (4 by default: TP=1, 2 and 4 all split them). Its weights are random
(``torch.manual_seed(seed)``), so its greedy tokens barely depend on the context (it repeats
one token): tests compare log-probabilities as well as tokens. The directory is built once per
shape under the model cache (``smollm2.cache_root()``), written beside the target and renamed
into place (a reader never sees half a model), and saved with ``save_pretrained`` in float32.

Runs in either venv (transformers and torch are in both); the tokenizer files are copied from
the converted SmolLM2 directory (``smollm2.convert()``), whose vocabulary this model takes.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from typing import NamedTuple

from prefixd.tools import smollm2

MARKER_FILE = "prefixd-tiny-llama.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class Shape(NamedTuple):
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 0  # 0: 4 x hidden_size
    seed: int = 0

    def dir_name(self) -> str:
        return (f"tiny-llama-l{self.num_layers}-h{self.hidden_size}-a{self.num_heads}-kv{self.num_kv_heads}"
                f"-i{self.intermediate()}-s{self.seed}")

    def intermediate(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size


def build(root: pathlib.Path | None = None, **shape) -> pathlib.Path:
    """The model directory of ``Shape(**shape)``, made on first use; returns it.

    Raises:
        ValueError: heads that do not divide the hidden size or the KV heads.
        smollm2.SmolLM2Missing: no SmolLM2 to take the tokenizer from.
    """
    s = Shape(**shape)
    if s.hidden_size % s.num_heads or s.num_heads % s.num_kv_heads:
        raise ValueError(f"{s}: num_heads must divide hidden_size and num_kv_heads must divide num_heads")
    root = root or smollm2.cache_root()
    target = root / s.dir_name()
    if (target / MARKER_FILE).is_file():
        return target
    source = smollm2.convert()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=s.hidden_size, intermediate_size=s.intermediate(),
                         num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                         num_key_value_heads=s.num_kv_heads, max_position_embeddings=8192,
                         tie_word_embeddings=True, torch_dtype="float32")
    torch.manual_seed(s.seed)
    model = LlamaForCausalLM(config).eval()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy(source / name, tmp / name)
        (tmp / MARKER_FILE).write_text(json.dumps(s._asdict()) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:  # another process made it first: keep theirs
            if not (target / MARKER_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(build())
