"""A pool allocated whole (``TensorPool`` with no file: the device tier on a GPU) is charged
whole to its tier's ledger when it opens, refused with nothing charged when that does not fit,
and gives it all back when it closes. The whole pool lives on ``device``: CUDA in the daemon,
the CPU here (no GPU on this host; the accounting is the same code)."""

import pytest

from prefixd.api.layout import KVLayout
from prefixd.api.tiers import DEVICE
from prefixd.storage.budget_ledger import BudgetLedger
from prefixd.storage.errors import BudgetExceededError
from prefixd.storage.pools import TensorPool

MiB = 1 << 20
LAYOUT = KVLayout("whole", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_size=16)


def test_a_whole_pool_is_charged_whole_at_open_and_given_back_at_close():
    ledger = BudgetLedger("device", 8 * MiB)
    pool = TensorPool(LAYOUT, DEVICE, 64, path=None, ledger=ledger, tenant="a", device="cpu")
    assert pool.fixed_bytes == 64 * LAYOUT.block_bytes == ledger.used_by("a")
    assert pool.sparse is None and pool.tensor.shape[0] == 64
    pool.close()
    assert ledger.used_bytes == 0 and pool.fixed_bytes == 0
    ledger.check_invariants()


def test_a_whole_pool_that_does_not_fit_is_refused_with_nothing_charged():
    ledger = BudgetLedger("device", 8 * MiB, tenants=[("b", None, 6 * MiB)])
    with pytest.raises(BudgetExceededError, match=r"raise \[engine.budget\] device"):
        TensorPool(LAYOUT, DEVICE, 256, path=None, ledger=ledger, tenant="a", device="cpu")  # 4 MiB
    assert ledger.used_bytes == 0
    ledger.check_invariants()
