"""``Size``: a byte count as an operator writes it, a number of bytes or a share of what is there.

Spellings (``Size.parse``):

- an integer: bytes (``1073741824``); a string of digits too (``"1073741824"``);
- a number and a unit, optionally with a space between: ``"512MiB"``, ``"1.5 TiB"``, ``"24GB"``.
  Binary units are powers of 1024 (``KiB``, ``MiB``, ``GiB``, ``TiB``), decimal units powers of
  1000 (``KB``, ``MB``, ``GB``, ``TB``), ``B`` is bytes; units are matched without regard to case
  (``"4gib"`` is ``"4GiB"``). A fraction rounds down to whole bytes;
- a percentage: ``"50%"``, ``"12.5%"`` (more than 0, at most 100), of a total that the caller
  supplies when it resolves the size (``Size.resolve``): the GPU's memory, MemTotal, a
  filesystem's size.

NOTE: ``"1.5TB"`` means 1.5 x 10^12 bytes, as a disk vendor and ``df -H`` count, while
``"1.5TiB"`` is 1.5 x 2^40, as ``free -b`` and ``nvidia-smi`` count; both are accepted because
operators copy numbers from either. ``K``/``M``/``G`` alone are refused: whether ``"4G"`` means
4 x 10^9 or 4 x 2^30 differs between tools (systemd's ``MemoryMax=4G`` is binary, ``df -H`` is
not), and the 7% between them is worth a refusal.
"""

from __future__ import annotations

import dataclasses
import math
import re

from prefixd.config.errors import ConfigError

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
_PERCENT = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*")
SPELLING = ('a size such as "24GiB", "512MiB", "1.5TiB", "500GB", a whole number of bytes, '
            'or a percentage such as "50%"')


@dataclasses.dataclass(frozen=True)
class Size:
    """One configured size: ``text`` as written (an int of bytes or a string), and what it
    says: ``num_bytes`` (absolute) or ``percent`` (a share), exactly one of them not None.

    Equality is on what it says, not on how it is spelt: ``"8GiB"``, ``"8192MiB"`` and
    ``8589934592`` are one size (a reload that respells a budget changes nothing), and
    ``text`` is what the TOML writer writes back. Build with ``Size.parse(key, value)``,
    which names ``key`` in its error.
    """

    text: int | str = dataclasses.field(compare=False)
    num_bytes: int | None = None
    percent: float | None = None

    @classmethod
    def parse(cls, key: str, value) -> "Size":
        """The size ``value`` says; ``key`` (e.g. ``engine.budget.host``) names it in errors.

        Raises:
            ConfigError: not one of the spellings, a negative size, a percentage outside
                (0, 100], or an unknown unit; the message names the key and the spellings.
        """
        if isinstance(value, Size):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{key} must be {SPELLING}, got {value!r}")
        if isinstance(value, int):
            if value < 0:
                raise ConfigError(f"{key} must be a size >= 0, got {value}: write {SPELLING}")
            return cls(value, value, None)
        match = _PERCENT.fullmatch(value)
        if match:
            percent = float(match.group(1))
            if not 0 < percent <= 100:
                raise ConfigError(f"{key} = {value!r}: a percentage must be more than 0% and at "
                                  f"most 100%")
            return cls(value, None, percent)
        match = _SIZE.fullmatch(value)
        if not match:
            raise ConfigError(f"{key} must be {SPELLING}, got {value!r}")
        number, unit = match.groups()
        if not unit:
            if "." in number:
                raise ConfigError(f"{key} = {value!r}: a fraction needs a unit (\"1.5GiB\"); "
                                  f"bytes are whole")
            return cls(value, int(number), None)
        factor = UNITS.get(unit.lower())
        if factor is None:
            raise ConfigError(f"{key} = {value!r}: unknown unit {unit!r}; use one of B, KiB, "
                              f"MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)")
        return cls(value, math.floor(float(number) * factor), None)

    @property
    def is_percent(self) -> bool:
        return self.percent is not None

    def resolve(self, total: int) -> int:
        """Bytes: ``num_bytes``, or ``percent`` of ``total`` rounded down."""
        if self.num_bytes is not None:
            return self.num_bytes
        return int(total * self.percent // 100)


def format_bytes(n: int) -> str:
    """``n`` bytes for a person: ``"1.5 GiB (1610612736 bytes)"``."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"
