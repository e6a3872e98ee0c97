"""prefixd.storage: the physical tiers (see DESIGN.md and ``prefixd.storage.tier_store`` for the API).

Modules, one concept each: ``slots`` (free-slot allocators), ``poolfile`` (file format, header
checks, allocation), ``pools`` (device/host tensors, disk files), ``checksum`` (per-block xxh3-64),
``movement`` (batched copies between pools), ``tier_store`` (the facade the cache core calls),
``extents`` (sparse pool files that grow and shrink by extents; ``extent_map`` their bookkeeping,
``falloc`` fallocate and hole punching), ``budget_ledger`` (a tier's bytes against its budget
and its tenants' quotas), ``errors``.
"""
