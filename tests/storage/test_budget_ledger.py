"""``BudgetLedger``: charges against a tier's budget, tenants' max and reserved bytes, the log's
room, what eviction must free, and a model-checked random walk."""

import random

import pytest

from prefixd.config.budget_settings import Budget, BudgetSpec, Machine, TenantQuota
from prefixd.storage.budget_ledger import BudgetLedger, Shortfall
from prefixd.storage.errors import BudgetExceededError

MiB = 1 << 20


def ledger(**kw):
    kw.setdefault("tenants", [("a", None, 0), ("b", None, 0)])
    return BudgetLedger("host", kw.pop("budget", 100), **kw)


def test_charges_fit_up_to_the_budget_and_release_gives_them_back():
    led = ledger()
    assert led.can_charge("a", 100) and not led.can_charge("a", 101)
    led.charge("a", 60)
    led.check_invariants()
    assert not led.can_charge("b", 41) and led.can_charge("b", 40)
    led.charge("b", 40)
    led.check_invariants()
    assert (led.used_bytes, led.free_bytes, led.by_tenant()) == (100, 0, {"a": 60, "b": 40})
    led.release("a", 60)
    led.check_invariants()
    assert led.used_by("a") == 0 and led.free_bytes == 60 and led.can_charge("b", 60)


def test_a_charge_that_does_not_fit_is_refused_whole_naming_the_key():
    led = ledger()
    led.charge("a", 90)
    with pytest.raises(BudgetExceededError, match=r"host budget cannot take 20 more bytes .*"
                                                  r"\[engine.budget\] host"):
        led.charge("b", 20)
    led.check_invariants()
    assert led.used_bytes == 90 and led.used_by("b") == 0


def test_the_logs_room_is_taken_out_of_the_budget_first():
    led = BudgetLedger("disk", 100, log_reserve=30)
    assert led.capacity == 70 and led.log_reserve == 30
    assert led.can_charge("x", 70) and not led.can_charge("x", 71)


def test_a_tenant_at_its_max_is_refused_and_must_evict_its_own_blocks():
    led = ledger(tenants=[("a", 50, 0), ("b", None, 0)])
    led.charge("a", 40)
    assert not led.can_charge("a", 11) and led.can_charge("b", 60)
    assert led.shortfall("a", 11) == Shortfall(own_bytes=1, total_bytes=1)
    assert led.shortfall("a", 10) == Shortfall(0, 0)
    led.check_invariants()


def test_reserved_bytes_of_one_tenant_are_never_available_to_another():
    """Planted bug this catches: ``_fits`` comparing ``used_bytes + n`` with the capacity
    instead of the footprint lets B take A's unused reservation."""
    led = ledger(tenants=[("a", None, 30), ("b", None, 0)])
    assert led.free_bytes == 70
    assert not led.can_charge("b", 71) and led.can_charge("b", 70)
    assert led.can_charge("a", 100)                    # its own reservation is its to use
    led.charge("b", 70)
    assert not led.can_charge("b", 1)
    assert led.can_charge("a", 30) and not led.can_charge("a", 31)
    led.charge("a", 30)
    led.check_invariants()
    assert led.shortfall("b", 5) == Shortfall(0, 5)


def test_eviction_may_take_another_tenants_blocks_only_above_its_reservation():
    led = ledger(tenants=[("a", None, 30), ("b", None, 0)])
    led.charge("a", 40)
    assert led.may_evict("a", 10, for_tenant="b")       # 40 - 10 >= 30 reserved
    assert not led.may_evict("a", 11, for_tenant="b")   # would dig into a's reservation
    assert led.may_evict("a", 40, for_tenant="a")       # its own blocks always may go
    assert led.may_evict("b", 0, for_tenant="a")


def test_an_unknown_tenant_has_no_cap_and_no_reservation():
    led = ledger()
    led.charge("stranger", 100)
    led.check_invariants()
    assert led.used_by("stranger") == 100 and not led.can_charge("a", 1)


@pytest.mark.parametrize("kw, words", [
    ({"budget": -1}, ["must be >= 0"]),
    ({"log_reserve": -5}, ["must be >= 0"]),
    ({"tenants": [("a", 10, 20)]}, ["'a' reserves 20 bytes with a max of 10"]),
    ({"tenants": [("a", None, 60), ("b", None, 50)]}, ["reservations of 110 bytes do not fit"]),
    ({"log_reserve": 50, "tenants": [("a", None, 60)]}, ["less the log's 50"]),
])
def test_a_ledger_that_cannot_hold_its_quotas_is_refused(kw, words):
    with pytest.raises(ValueError) as err:
        ledger(**kw)
    for word in words:
        assert word in str(err.value)


def test_releasing_more_than_held_or_charging_a_negative_is_a_caller_bug():
    led = ledger()
    led.charge("a", 10)
    with pytest.raises(ValueError, match="releases 11 bytes but holds 10"):
        led.release("a", 11)
    with pytest.raises(ValueError, match="releases -1"):
        led.release("a", -1)
    with pytest.raises(ValueError, match="cannot charge -1"):
        led.charge("a", -1)
    led.check_invariants()


def test_a_ledger_for_a_tier_of_a_resolved_budget_carries_the_tenants_quotas():
    tenants = (TenantQuota("a", max={"disk": "64MiB"}, reserved={"disk": "16MiB"}),
               TenantQuota("b"))
    budget = Budget.resolve(BudgetSpec(disk="256MiB"), Machine(1 << 34, 1 << 40), tenants)
    led = BudgetLedger.for_tier(budget, "disk", log_reserve=32 * MiB)
    assert led.capacity == 224 * MiB and led.free_bytes == 208 * MiB
    assert not led.can_charge("a", 64 * MiB + 1) and led.can_charge("a", 64 * MiB)
    assert not led.can_charge("b", 208 * MiB + 1)


def test_a_random_walk_matches_a_plain_model():
    """Charges and releases by three tenants against the rules written out plainly; the
    ledger's answers and its invariants hold after every step."""
    rng = random.Random(7)
    quotas = {"a": (400, 100), "b": (None, 200), "c": (None, 0)}
    led = BudgetLedger("disk", 1000, log_reserve=100,
                       tenants=[(n, m, r) for n, (m, r) in quotas.items()])
    used = dict.fromkeys(quotas, 0)

    def fits(t, n):
        cap, _ = quotas[t]
        if cap is not None and used[t] + n > cap:
            return False
        after = dict(used, **{t: used[t] + n})
        return sum(max(after[u], quotas[u][1]) for u in quotas) <= 900

    for _ in range(3000):
        t = rng.choice("abc")
        if rng.random() < 0.6:
            n = rng.randrange(0, 150)
            assert led.can_charge(t, n) == fits(t, n)
            if fits(t, n):
                led.charge(t, n)
                used[t] += n
        elif used[t]:
            n = rng.randrange(1, used[t] + 1)
            led.release(t, n)
            used[t] -= n
        led.check_invariants()
        assert led.by_tenant() == used


def test_available_is_the_largest_charge_that_fits():
    """``available``: within the tenant's max, without others' unused reservations, with its
    own; charging exactly that fits and one byte more does not."""
    ledger = BudgetLedger("device", 100, tenants=[("a", 60, 10), ("b", None, 30)])
    ledger.charge("b", 5)
    for tenant, want in (("a", 60), ("b", 85), ("c", 60)):
        n = ledger.available(tenant)
        assert n == want, (tenant, n)
        assert ledger.can_charge(tenant, n) and not ledger.can_charge(tenant, n + 1)
