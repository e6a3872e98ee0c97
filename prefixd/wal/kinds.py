"""The record kinds: one table row per kind, its code, its fixed fields, and whether it has a blob.

Adding a kind is one new row in ``KIND_SPECS`` with an unused code; the ``Kind`` enum, the
precompiled structs and the kinds table saved in meta follow from it. Never reuse or renumber a
code and never change a row's fields: the state directory saves this table and refuses to open
with one that changed an existing kind (new kinds are accepted; see ``meta.check_kinds``).

Field formats are ``struct`` codes, packed little-endian without padding:
``Q`` = u64, ``I`` = u32, ``B`` = u8, ``d`` = f64.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple


class KindSpec(NamedTuple):
    """One record kind: ``code`` (u8, never reused), ``name``, ``fields`` as (name, struct code)
    pairs in wire order, ``blob`` (whether a trailing byte string follows the fields)."""

    code: int
    name: str
    fields: tuple[tuple[str, str], ...]
    blob: bool


def _kind(code: int, name: str, fields: str, blob: bool = False) -> KindSpec:
    pairs = tuple(tuple(f.split(":")) for f in fields.split())
    return KindSpec(code, name, pairs, blob)  # type: ignore[arg-type]


# fmt: off
KIND_SPECS: tuple[KindSpec, ...] = (
    _kind(1,  "ATTACH",     "session_id:Q epoch:I", blob=True),       # blob: client name, utf-8
    _kind(2,  "DETACH",     "session_id:Q"),
    _kind(3,  "OPEN",       "seq_id:Q session_id:Q num_tokens:I num_cached_blocks:I", blob=True),
    _kind(4,  "EXTEND",     "seq_id:Q num_tokens:I", blob=True),
    _kind(5,  "COW",        "seq_id:Q old_slot:I new_slot:I"),
    _kind(6,  "FORK",       "parent_seq_id:Q first_child_id:Q num_children:I"),
    _kind(7,  "COMMIT",     "seq_id:Q num_blocks:I", blob=True),
    _kind(8,  "RELEASE",    "seq_id:Q"),
    _kind(9,  "BLOCK_PUT",  "tier:B num_blocks:I", blob=True),
    _kind(10, "BLOCK_MOVE", "tier:B num_blocks:I", blob=True),
    _kind(11, "BLOCK_DROP", "tier:B num_blocks:I", blob=True),
    _kind(12, "TOUCH",      "time:d num_blocks:I", blob=True),
    _kind(13, "RECOVER",    "epoch:I host_kept:B"),  # a recovery ran here: see prefixd.engine.replay
)
# fmt: on

Kind = enum.IntEnum("Kind", {spec.name: spec.code for spec in KIND_SPECS})  # type: ignore[misc]
Kind.__doc__ = "Record kind codes (u8). Generated from KIND_SPECS."


class KindCodec(NamedTuple):
    """A kind's precompiled layout: ``struct`` packs kind (u8) + the fixed fields."""

    kind: Kind
    spec: KindSpec
    struct: struct.Struct
    fixed_size: int
    num_fields: int


def _compile(spec: KindSpec) -> KindCodec:
    fmt = "<B" + "".join(code for _, code in spec.fields)
    st = struct.Struct(fmt)
    return KindCodec(Kind(spec.code), spec, st, st.size, len(spec.fields))


def _check_table(specs: tuple[KindSpec, ...]) -> None:
    codes = [s.code for s in specs]
    if len(set(codes)) != len(codes) or not all(0 < c < 256 for c in codes):
        raise ValueError(f"kind codes must be unique u8 values > 0: {codes}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"kind names must be unique: {names}")


_check_table(KIND_SPECS)

# code -> codec; a 256-entry list so the hot path is one index, not a dict lookup.
CODECS: list[KindCodec | None] = [None] * 256
for _spec in KIND_SPECS:
    CODECS[_spec.code] = _compile(_spec)
del _spec


def field_names(kind: int) -> tuple[str, ...]:
    """Names of ``kind``'s fixed fields in wire order (for tools and error messages)."""
    codec = CODECS[kind]
    if codec is None:
        raise ValueError(f"unknown record kind {kind}")
    return tuple(name for name, _ in codec.spec.fields)


def kinds_table() -> list[list[object]]:
    """The kinds table as saved in meta: ``[[code, name, field formats, has_blob], ...]``."""
    return [[s.code, s.name, "".join(c for _, c in s.fields), s.blob] for s in KIND_SPECS]
