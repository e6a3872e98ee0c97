"""``prefixctl lookup``'s inputs: the prompt's token ids (given, or from text through a local
tokenizer) and the pool whose layout to attach with."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

from prefixd.api import prefixd_pb2 as pb

MAX_TOKEN = 2**31 - 1


def parse_token_ids(words: Iterable[str]) -> list[int]:
    """Token ids from command-line words: ``1 2 3``, ``1,2,3`` or ``[1, 2, 3]`` (a list
    printed by Python).

    Raises ValueError: a word that is not an integer in ``[0, 2**31)``.
    """
    ids = []
    for word in words:
        for piece in word.replace("[", " ").replace("]", " ").replace(",", " ").split():
            try:
                value = int(piece)
            except ValueError:
                raise ValueError(f"token id {piece!r} is not an integer (pass ids, or --text with "
                                 f"--tokenizer)") from None
            if not 0 <= value <= MAX_TOKEN:
                raise ValueError(f"token id {value} is out of range: ids are in [0, 2**31)")
            ids.append(value)
    return ids


def tokenize(text: str, tokenizer: str, *, special_tokens: bool = True) -> list[int]:
    """``text``'s token ids by the Hugging Face tokenizer in directory ``tokenizer``.

    NOTE: transformers is imported here only (it takes seconds and is an optional dependency,
    ``pip install prefixd[hf]``), and only from a local directory: prefixctl runs on serving
    hosts, which must not reach out to a hub. Give the same directory (and ``--no-special-tokens``
    if the engine tokenizes without them) as the engine, or the ids and the hits differ.

    Raises ValueError: no such directory, transformers missing, or the tokenizer does not load.
    """
    if not os.path.isdir(tokenizer):
        raise ValueError(f"--tokenizer {tokenizer!r} is not a directory: give the local directory "
                         f"of a Hugging Face tokenizer (prefixctl downloads nothing)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError("--tokenizer needs transformers: pip install 'prefixd[hf]'") from None
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {tokenizer}: {exc}") from None
    return list(tok.encode(text, add_special_tokens=special_tokens))


def tokens_from_args(words: list[str], text: str | None, tokenizer: str | None, *,
                     special_tokens: bool = True) -> list[int]:
    """The prompt of ``prefixctl lookup``: ids, or ``--text`` with ``--tokenizer``.

    Raises ValueError: both or neither given, ``--text`` without ``--tokenizer``, bad ids.
    """
    if text is not None and words:
        raise ValueError("give token ids or --text, not both")
    if text is not None:
        if not tokenizer:
            raise ValueError("--text needs --tokenizer DIR (the engine's tokenizer directory)")
        ids = tokenize(text, tokenizer, special_tokens=special_tokens)
    else:
        if tokenizer:
            raise ValueError("--tokenizer goes with --text")
        ids = parse_token_ids(words)
    if not ids:
        raise ValueError("no tokens: give token ids, or --text with --tokenizer")
    return ids


def pack(ids: list[int]) -> bytes:
    """Token ids as the proto's packed little-endian int32 bytes."""
    return struct.pack(f"<{len(ids)}i", *ids)


def pick_layout(pools: Iterable[pb.PoolStatus], model: str | None) -> pb.KVLayout:
    """The layout of the pool to look up in: the one of model ``model``, or the only pool.

    Raises LookupError: no pool, several and no ``model``, none of ``model``, or several of
    ``model`` (the same model id under different layouts).
    """
    pools = list(pools)
    if not pools:
        raise LookupError("the daemon has no pool on this socket yet: nothing is cached (a pool is "
                          "made when the first client attaches with its KV layout)")
    models = ", ".join(sorted({p.model_id for p in pools}))
    if model is None:
        if len(pools) > 1:
            raise LookupError(f"the daemon has {len(pools)} pools ({models}): choose one with "
                              f"--model MODEL_ID")
        return pools[0].layout
    matches = [p for p in pools if p.model_id == model]
    if not matches:
        raise LookupError(f"no pool of model {model!r} on this socket; its pools are: {models}")
    if len(matches) > 1:
        raise LookupError(f"model {model!r} has {len(matches)} pools with different KV layouts; "
                          f"prefixctl cannot tell which: ask through the client library")
    return matches[0].layout
