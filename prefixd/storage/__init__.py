"""prefixd.storage: the physical tiers (see DESIGN.md and ``prefixd.storage.tier_store`` for the API).

Modules, one concept each: ``slots`` (free-slot allocators), ``poolfile`` (file format, header
checks, allocation), ``pools`` (device/host tensors, disk files), ``checksum`` (per-block xxh3-64),
``movement`` (batched copies between pools), ``tier_store`` (the facade the cache core calls),
``errors``.
"""
