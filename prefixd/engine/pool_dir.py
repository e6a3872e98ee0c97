"""The pool directory of an engine: ``<state_dir>/pools/<tenant>/<model>-<digest16>/`` and
the manifest (``pool.json``) that makes each pool recoverable by name.

A manifest names the pool's tenant, layout bytes, a print of the tenant's salt and the slots per
tier fixed when the pool was made. It is written (and fsynced, with its directory entries)
before the pool's WAL exists, so a pool directory either has a manifest or was never used.
``PoolDirectory`` is the part of ``prefixd.engine.engine.Engine`` that places pools, writes
their manifests and finds (checking) the pools on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re

from prefixd.api.layout import KVLayout
from prefixd.config.engine_settings import EngineConfig, Tenant
from prefixd.engine.errors import PoolDirError

log = logging.getLogger(__name__)

POOLS_DIR = "pools"
MANIFEST = "pool.json"
MANIFEST_FORMAT = 1


def pool_dir_name(layout: KVLayout) -> str:
    """The directory of a layout's pool: readable model id, then the layout digest (the key)."""
    model = re.sub(r"[^A-Za-z0-9_.-]", "_", layout.model_id)[:48].lstrip(".") or "model"
    return f"{model}-{layout.digest()[:8].hex()}"


def salt_print(salt: bytes) -> str:
    """What a manifest keeps of a tenant's salt: enough to notice a change, not the salt."""
    return hashlib.blake2b(salt, digest_size=16, person=b"prefixd-salt").hexdigest()


class PoolDirectory:
    """The ``pools/`` directory of ``state_dir``: where each pool lives, and its manifest.

    ``unconfigured`` lists the tenant directories ``found`` left closed (their tenant is no
    longer configured).
    """

    def __init__(self, state_dir: str) -> None:
        self.root = os.path.join(state_dir, POOLS_DIR)
        self.unconfigured: list[str] = []

    def path(self, tenant: str, layout: KVLayout) -> str:
        """Where the pool of ``tenant`` and ``layout`` lives (whether or not it exists)."""
        return os.path.join(self.root, tenant, pool_dir_name(layout))

    def write_manifest(self, tenant: Tenant, layout: KVLayout, sizes) -> None:
        """Write the manifest of a new pool of ``tenant`` and ``layout`` (``sizes``: slots per
        tier) durably, before anything else is put in its directory."""
        _write_manifest(self.path(tenant.name, layout), tenant, layout, sizes)

    def manifest_sizes(self, tenant: Tenant, layout: KVLayout) -> tuple | None | bool:
        """The slots per tier the manifest of an existing (closed) pool of ``tenant`` and
        ``layout`` keeps (None: a manifest from before budgets); False: no such pool.

        Raises:
            PoolDirError: see ``found``.
        """
        path = self.path(tenant.name, layout)
        if not os.path.isfile(os.path.join(path, MANIFEST)):
            return False
        read = _read_manifest(path, tenant)
        return False if read is None else read[1]

    def found(self, config: EngineConfig) -> list[tuple[Tenant, KVLayout, tuple | None]]:
        """The pools on disk whose tenant is configured in ``config``, each checked against its
        manifest, with its slots per tier."""
        root = self.root
        if not os.path.isdir(root):
            return []
        found = []
        for tenant_name in sorted(os.listdir(root)):
            tenant_dir = os.path.join(root, tenant_name)
            if not os.path.isdir(tenant_dir):
                continue
            tenant = config.tenant(tenant_name)
            if tenant is None:
                # NOTE: a tenant taken out of the configuration keeps its pools on disk, unseen
                # and unserved; adding it back (same salt) serves them again.
                log.warning("pools of an unconfigured tenant left closed path=%s", tenant_dir)
                self.unconfigured.append(tenant_dir)
                continue
            for name in sorted(os.listdir(tenant_dir)):
                read = _read_manifest(os.path.join(tenant_dir, name), tenant)
                if read is not None:
                    found.append((tenant, *read))
        return found


def _read_manifest(path: str, tenant: Tenant) -> tuple[KVLayout, tuple | None] | None:
    """The layout of the pool in ``path`` and its sizes in slots per tier (None in a manifest
    from before byte budgets), checked; None for a creation that never finished.

    Raises:
        PoolDirError: no manifest beside pool data, a damaged one, or one that disagrees with
            the directory's place or the tenant's salt.
    """
    manifest = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest):
        leftovers = set(os.listdir(path)) - {MANIFEST + ".tmp"}
        if leftovers:
            raise PoolDirError(path, f"it holds {sorted(leftovers)} but no {MANIFEST}, so its "
                               f"tenant and layout are unknown: restore {MANIFEST} from a backup, "
                               f"or move the directory out of the state directory")
        # a pool() that crashed before its manifest landed: nothing was ever stored in it
        for leftover in os.listdir(path):
            os.unlink(os.path.join(path, leftover))
        os.rmdir(path)
        log.info("removed the directory of a pool whose creation never finished path=%s", path)
        return None
    try:
        with open(manifest, "rb") as f:
            meta = json.loads(f.read())
        if meta.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"manifest format {meta.get('format')!r}, this build reads "
                             f"{MANIFEST_FORMAT}")
        layout = KVLayout.from_bytes(bytes.fromhex(meta["layout"]))
        tenant_name, printed = meta["tenant"], meta["salt_print"]
        sizes = meta.get("num_slots")
        if sizes is not None:
            sizes = tuple(int(n) for n in sizes)
            if len(sizes) != 3 or min(sizes) < 0:
                raise ValueError(f"num_slots {sizes!r} is not three slot counts")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PoolDirError(path, f"{MANIFEST} cannot be read ({exc}): restore it from a backup, "
                           f"or move the directory out of the state directory") from exc
    if tenant_name != tenant.name or pool_dir_name(layout) != os.path.basename(path):
        raise PoolDirError(path, f"{MANIFEST} names tenant {tenant_name!r} and a layout stored "
                           f"as {pool_dir_name(layout)!r}, not this directory: move it back "
                           f"where it came from")
    if printed != salt_print(tenant.salt):
        raise PoolDirError(path, f"tenant {tenant.name!r} has a different salt than when this "
                           f"pool was made, and its blocks were named under the old one: restore "
                           f"the old salt in [[engine.tenants]], or delete the directory to "
                           f"drop that cache")
    return layout, sizes


def _write_manifest(path: str, tenant: Tenant, layout: KVLayout, sizes) -> None:
    """Write ``path/pool.json`` durably (file, then every new directory entry up to the state
    directory) before anything else is put in ``path``."""
    os.makedirs(path, mode=0o750, exist_ok=True)
    data = json.dumps({"format": MANIFEST_FORMAT, "tenant": tenant.name,
                       "model_id": layout.model_id, "layout": layout.to_bytes().hex(),
                       "salt_print": salt_print(tenant.salt),
                       "num_slots": list(sizes)}, indent=1).encode()
    tmp = os.path.join(path, MANIFEST + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, os.path.join(path, MANIFEST))
    tenant_dir = os.path.dirname(path)
    for directory in (path, tenant_dir, os.path.dirname(tenant_dir)):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
