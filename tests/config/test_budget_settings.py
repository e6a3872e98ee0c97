"""Byte budgets: sizes as written, ``BudgetSpec``, tenants' ``max`` / ``reserved``, the
defaults, resolution against a machine and every error message, tested on
``prefixd.config.sizes`` and ``prefixd.config.budget_settings`` directly; and that a config
file's ``[engine.budget]`` and tenants' ``max`` / ``reserved`` load, write back, and are
checked when the file is read."""

import dataclasses

import pytest

from prefixd.config import ConfigError
from prefixd.config.budget_settings import (Budget, BudgetSpec, Machine, Quota, TenantQuota,
                                            check_quotas, filesystem_bytes, mem_total_bytes)
from prefixd.config.sizes import Size
from prefixd.config.toml_reader import read_engine_config

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
LAPTOP = Machine(mem_total=16 * GiB, disk_total=256 * GiB)        # no GPU
BIG = Machine(mem_total=2048 * GiB, disk_total=30 * 1024 * GiB, gpu_total=80 * GiB)

SPEC = BudgetSpec(device="2GiB", host="25%", disk="1.5TiB")
TENANTS = (TenantQuota("acme", max={"host": "8GiB", "disk": "50%"}, reserved={"host": "1GiB"}),
           TenantQuota("globex", reserved={"disk": "100GB", "device": 536870912}))


def test_budget_keys_in_a_config_file_load_and_write_back():
    """``[engine.budget]`` and a tenant's ``max`` / ``reserved`` are read (the engine enforces
    them), and the TOML writer writes them back to the same config."""
    from prefixd.config.toml_writer import engine_toml

    config = read_engine_config(b"[engine.budget]\nhost = '64MiB'\ndisk = '10%'\n"
                                b"[[engine.tenants]]\nname = 'a'\nsalt = 'x'\n"
                                b"max = { host = '32MiB' }\nreserved = { host = '8MiB' }\n")
    assert config.budget.host.num_bytes == 64 * MiB and config.budget.disk.percent == 10.0
    (tenant,) = config.tenants
    assert tenant.max.host.num_bytes == 32 * MiB and tenant.reserved.host.num_bytes == 8 * MiB
    assert read_engine_config(engine_toml(config).encode()) == config


def test_an_unknown_budget_or_quota_key_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match="unknown key 'ram' in \\[engine.budget\\].*device, host, disk"):
        read_engine_config(b"[engine.budget]\nram = '4GiB'\n")
    with pytest.raises(ConfigError, match="unknown tier 'ram'"):
        read_engine_config(b"[[engine.tenants]]\nname = 'a'\nmax = { ram = '1GiB' }\n")


def test_reservations_over_a_budget_in_a_config_file_are_refused_naming_the_keys():
    text = (b"[engine.budget]\nhost = '1GiB'\n"
            b"[[engine.tenants]]\nname = 'a'\nsalt = 'a'\nreserved = { host = '768MiB' }\n"
            b"[[engine.tenants]]\nname = 'b'\nsalt = 'b'\nreserved = { host = '512MiB' }\n")
    with pytest.raises(ConfigError, match=r"reserved.host add up to .*engine.budget.host"):
        read_engine_config(text)


@pytest.mark.parametrize("text, num_bytes", [
    (0, 0), (4096, 4096), ("4096", 4096), ("512B", 512),
    ("1KiB", KiB), ("512MiB", 512 * MiB), ("24GiB", 24 * GiB), ("1.5TiB", 3 * (1 << 39)),
    ("1KB", 1000), ("2MB", 2_000_000), ("24GB", 24 * 10**9), ("1.5TB", 1_500_000_000_000),
    ("4gib", 4 * GiB), (" 8 GiB ", 8 * GiB), ("0.5KiB", 512), ("1.0001KiB", 1024),
])
def test_a_size_with_units_is_bytes_binary_units_by_1024_decimal_by_1000(text, num_bytes):
    size = Size.parse("k", text)
    assert size.num_bytes == num_bytes and not size.is_percent
    assert size.resolve(123) == num_bytes


@pytest.mark.parametrize("text, percent, total, resolved", [
    ("50%", 50.0, 1000, 500), ("12.5%", 12.5, 1000, 125), ("100%", 100.0, 7, 7), ("1%", 1.0, 99, 0),
])
def test_a_percentage_resolves_against_the_total_rounding_down(text, percent, total, resolved):
    size = Size.parse("k", text)
    assert size.percent == percent and size.num_bytes is None
    assert size.resolve(total) == resolved


@pytest.mark.parametrize("value, words", [
    (-1, ["engine.budget.host", ">= 0"]),
    (True, ["engine.budget.host", '"24GiB"', '"50%"']),
    (1.5, ["engine.budget.host", "got 1.5"]),
    ("lots", ["engine.budget.host", "'lots'"]),
    ("4G", ["engine.budget.host", "unknown unit 'G'", "KiB", "KB"]),
    ("4 pages", ["unknown unit 'pages'"]),
    ("1.5", ["engine.budget.host", "fraction needs a unit"]),
    ("0%", ["engine.budget.host", "more than 0%"]),
    ("101%", ["engine.budget.host", "at most 100%"]),
    ("-5%", ["engine.budget.host"]),
    ("5 %%", ["engine.budget.host"]),
])
def test_a_bad_size_is_refused_naming_the_key_and_the_spellings(value, words):
    with pytest.raises(ConfigError) as err:
        BudgetSpec(host=value)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_a_budget_and_quotas_hold_sizes_as_written():
    assert SPEC == BudgetSpec(device=2 * GiB, host="25.0%", disk="1536GiB")
    acme, globex = TENANTS
    assert acme.max == Quota(host="8GiB", disk="50%") and acme.reserved == Quota(host="1GiB")
    assert globex.max == Quota() and globex.reserved.disk.num_bytes == 100 * 10**9
    assert globex.reserved.device.num_bytes == 512 * MiB
    assert acme.max.as_table() == {"host": "8GiB", "disk": "50%"} and Quota().as_table() == {}
    assert SPEC.host.text == "25%" and SPEC.device.text == "2GiB"


def test_the_defaults_are_safe_on_a_laptop_and_capped_on_a_big_host():
    laptop = Budget.resolve(BudgetSpec(), LAPTOP)
    assert laptop.host == int(16 * GiB * 0.10)          # 10% of MemTotal, under the 4 GiB cap
    assert laptop.device == laptop.host                 # no GPU: the device tier is host memory
    assert laptop.disk == int(256 * GiB * 0.10)         # 10% of the filesystem, under 32 GiB
    big = Budget.resolve(BudgetSpec(), BIG)
    assert (big.device, big.host, big.disk) == (4 * GiB, 4 * GiB, 32 * GiB)
    small_gpu = Budget.resolve(BudgetSpec(), dataclasses.replace(LAPTOP, gpu_total=24 * GiB))
    assert small_gpu.device == int(24 * GiB * 0.05)     # 5% of the GPU


def test_percentages_are_of_the_gpu_memtotal_and_the_filesystem():
    spec = BudgetSpec(device="50%", host="50%", disk="50%")
    on_gpu = Budget.resolve(spec, BIG)
    assert (on_gpu.device, on_gpu.host, on_gpu.disk) == (40 * GiB, 1024 * GiB, 15 * 1024 * GiB)
    on_cpu = Budget.resolve(spec, LAPTOP)
    assert on_cpu.device == 8 * GiB                     # of MemTotal: shm is host memory
    assert on_cpu.bytes_of("disk") == on_cpu.bytes_of(2) == 128 * GiB


def test_tenant_quotas_resolve_against_the_same_totals():
    budget = Budget.resolve(SPEC, BIG, TENANTS)
    acme, globex = budget.tenants
    assert acme.max == (None, 8 * GiB, 15 * 1024 * GiB) and acme.reserved == (0, GiB, 0)
    assert globex.max == (None, None, None) and globex.reserved == (512 * MiB, 0, 100 * 10**9)


def test_the_machine_probe_reads_memtotal_and_the_filesystem(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemFree:  10 kB\nMemTotal:       16384 kB\n")
    assert mem_total_bytes(str(meminfo)) == 16384 * 1024
    assert mem_total_bytes(str(tmp_path / "absent")) > 0        # falls back to sysconf
    machine = Machine.probe(str(tmp_path / "not" / "yet" / "made"), gpu_total=7)
    assert machine.disk_total == filesystem_bytes(str(tmp_path)) > 0
    assert machine.mem_total > 0 and machine.gpu_total == 7


@pytest.mark.parametrize("build, words", [
    (lambda: BudgetSpec(device=0), ["engine.budget.device must be more than 0"]),
    (lambda: BudgetSpec(host=0, disk="0GiB"), ["host and engine.budget.disk are both 0"]),
    (lambda: BudgetSpec(disk="2 TiBs"), ["engine.budget.disk", "unknown unit 'TiBs'"]),
    (lambda: TenantQuota("a", max="8GiB"), ["tenant 'a' max must be a table of tiers"]),
    (lambda: TenantQuota("a", max={"ram": "1GiB"}), ["tenant 'a' max", "'ram'",
                                                     "device, host, disk"]),
    (lambda: TenantQuota("a", reserved={"host": "x"}), ["tenant 'a' reserved.host"]),
    (lambda: check_quotas(BudgetSpec(), [TenantQuota("a", max={"host": "1GiB"},
                                                     reserved={"host": "2GiB"})]),
     ["tenant 'a'", "reserved.host ('2GiB') is above its max.host ('1GiB')", "[[engine.tenants]]"]),
    (lambda: check_quotas(BudgetSpec(), [TenantQuota("a", max={"disk": "10%"},
                                                     reserved={"disk": "20%"})]),
     ["reserved.disk ('20%') is above its max.disk ('10%')"]),
    (lambda: check_quotas(BudgetSpec(host="2GiB"), [TenantQuota("a", reserved={"host": "1GiB"}),
                                                    TenantQuota("b", reserved={"host": "1.5GiB"})]),
     ["reserved.host add up to 2.5 GiB", "'a' '1GiB'", "'b' '1.5GiB'", "engine.budget.host ('2GiB'",
      "raise [engine.budget] host"]),
    (lambda: check_quotas(BudgetSpec(disk="30%"), [TenantQuota("a", reserved={"disk": "20%"}),
                                                   TenantQuota("b", reserved={"disk": "15%"})]),
     ["reserved.disk add up to 35%", "engine.budget.disk ('30%': 30%)"]),
    (lambda: check_quotas(BudgetSpec(), [TenantQuota("a", reserved={"host": "5GiB"})]),
     ["reserved.host add up to 5.0 GiB", "engine.budget.host (the default: at most 4.0 GiB"]),
    (lambda: check_quotas(BudgetSpec(), [TenantQuota("a", reserved={"disk": "6%"}),
                                         TenantQuota("b", reserved={"disk": "5%"})]),
     ["reserved.disk add up to 11%", "engine.budget.disk (the default: at most 10%)"]),
])
def test_a_bad_budget_or_quota_is_refused_before_any_machine_is_known_naming_the_keys(build,
                                                                                    words):
    with pytest.raises(ConfigError) as err:
        build()
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_quotas_that_fit_or_cannot_be_compared_without_the_machine_pass_the_file_check():
    check_quotas(SPEC, TENANTS)
    check_quotas(BudgetSpec(host="10%"), [TenantQuota("a", max={"host": "5%"},
                                                      reserved={"host": "1GiB"})])
    check_quotas(BudgetSpec(), [TenantQuota("a", reserved={"disk": "5%"}),
                                TenantQuota("b", reserved={"disk": "5%"})])


def test_mixed_units_are_checked_when_the_machine_is_known():
    """A reservation in bytes against a budget in percent cannot be compared from the file:
    it loads, and resolving on a machine where it does not fit is the ConfigError."""
    spec = BudgetSpec(host="10%")
    tenants = [TenantQuota("a", max={"host": "5%"}, reserved={"host": "1GiB"})]
    check_quotas(spec, tenants)
    assert Budget.resolve(spec, BIG, tenants).tenants[0].reserved[1] == GiB
    with pytest.raises(ConfigError, match=r"reserved.host \(1.0 GiB .*\) is above its max.host"):
        Budget.resolve(spec, LAPTOP, tenants)        # 5% of 16 GiB < 1 GiB
    small = Machine(mem_total=8 * GiB, disk_total=GiB)
    tenants = [TenantQuota("a", reserved={"host": "1GiB"})]
    check_quotas(spec, tenants)
    with pytest.raises(ConfigError, match=r"add up to 1.0 GiB .* more than engine.budget.host "
                                          r"\('10%': 819.2 MiB"):
        Budget.resolve(spec, small, tenants)


def test_a_budget_that_resolves_to_nothing_is_refused_on_that_host():
    tiny = Machine(mem_total=50, disk_total=50)
    with pytest.raises(ConfigError, match="engine.budget.device resolves to 0 bytes on this host"):
        Budget.resolve(BudgetSpec(device="1%"), tiny)
    with pytest.raises(ConfigError, match="host and engine.budget.disk both resolve to 0"):
        Budget.resolve(BudgetSpec(host="1%", disk="1%"), tiny)
    with pytest.raises(ConfigError, match="engine.budget.disk resolved to -1"):
        Budget(1, 1, -1)


def test_reservations_within_the_defaults_bound_load_and_are_checked_at_start():
    """5% of the disk fits the default (at most 10%) at load; on a machine where the default
    is the 32 GiB cap and 5% is more, the start refuses it."""
    tenants = [TenantQuota("a", reserved={"disk": "5%"})]
    check_quotas(BudgetSpec(), tenants)
    assert Budget.resolve(BudgetSpec(), LAPTOP, tenants).tenants[0].reserved[2] > 0
    with pytest.raises(ConfigError, match="the default: 32.0 GiB"):
        Budget.resolve(BudgetSpec(), BIG, tenants)      # 5% of 30 TiB > 32 GiB


def test_a_size_is_what_it_says_not_how_it_is_spelt():
    assert BudgetSpec(host="8GiB") == BudgetSpec(host="8192MiB") == BudgetSpec(host=8 * GiB)
    assert BudgetSpec(disk="50%") == BudgetSpec(disk="50.0%") != BudgetSpec(disk="51%")
    assert BudgetSpec(host="1GB") != BudgetSpec(host="1GiB")
    assert Quota(host="8GiB") == Quota.of("q", {"host": 8 * GiB})
    assert TenantQuota("a", max={"host": "1GiB"}).max == Quota(host=Size.parse("x", "1GiB"))
