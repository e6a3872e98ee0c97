"""What ``prefixctl`` prints: the daemon's Status, Stats and Lookup replies as text for people
(and ``stats --json`` for scripts). Pure functions of the replies, so tests need no daemon."""

from __future__ import annotations

import json

from prefixd.api import prefixd_pb2 as pb

TIERS = ("device", "host", "disk")


def duration(seconds: float) -> str:
    """``3d 4h``, ``2h 5m``, ``7m 12s``, ``4.2s``: the two largest units."""
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s"
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {s}s"


def size_text(n: int) -> str:
    """``512 B``, ``64.0 MiB``, ``2.5 GiB``: binary units, as the budgets are written."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def state_line(reply: pb.StatusReply) -> str:
    """``serving``, ``recovering (replayed 1200 of 5000 log records, 24%)``, ``stopping``."""
    if reply.state != "recovering":
        return reply.state or "in an unknown state"
    if reply.records_total:
        pct = 100 * reply.records_replayed // reply.records_total
        return (f"recovering (replayed {reply.records_replayed} of {reply.records_total} log "
                f"records, {pct}%)")
    return "recovering (progress not reported yet)"


def layout_text(layout: pb.KVLayout) -> str:
    return (f"layers={layout.num_layers} kv_heads={layout.num_kv_heads} head_dim={layout.head_dim} "
            f"{layout.dtype} block_size={layout.block_size}")


def status_text(reply: pb.StatusReply, socket: str) -> str:
    """The ``prefixctl status`` report."""
    lines = [
        f"prefixd {reply.version or '?'}: {state_line(reply)}",
        f"  pid       {reply.pid}, up {duration(reply.uptime_s)}",
        f"  socket    {socket} (tenant {reply.tenant or '?'})",
        f"  sessions  {reply.sessions}",
    ]
    if reply.state == "recovering":
        lines.append("  pools     listed once recovery is done")
        return "\n".join(lines)
    for b in reply.budgets:
        reserve = f", {size_text(b.log_reserve_bytes)} of it kept for the logs" if b.log_reserve_bytes else ""
        lines.append(f"  {b.tier + ' budget':<13} {size_text(b.used_bytes)} used of "
                     f"{size_text(b.budget_bytes)} (this tenant {size_text(b.tenant_used_bytes)}{reserve})")
    if not reply.pools:
        lines.append("  pools     none yet (a pool is made by the first client that attaches "
                     "with its KV layout)")
        return "\n".join(lines)
    lines.append(f"  pools     {len(reply.pools)}")
    for pool in reply.pools:
        lines.append(f"    {pool.model_id}  ({layout_text(pool.layout)})")
        for i, tier in enumerate(TIERS):
            cap = pool.capacity[i] if i < len(pool.capacity) else 0
            if not cap:
                continue  # a tier this pool does not have
            used = pool.blocks[i] if i < len(pool.blocks) else 0
            lines.append(f"      {tier:<7} {used:>10} / {cap} blocks cached ({100 * used / cap:.0f}%)")
    return "\n".join(lines)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def stats_table(reply: pb.StatsReply) -> str:
    """Every value, one per line, sorted by name (Prometheus-style names)."""
    if not reply.values:
        return "(no values)"
    width = max(len(name) for name in reply.values)
    return "\n".join(f"{name:<{width}}  {_number(reply.values[name])}"
                     for name in sorted(reply.values))


def stats_json(reply: pb.StatsReply) -> str:
    """The daemon's nested document (tenant, pools, sessions) with the flat ``values`` beside.

    NOTE: one object so scripts parse one thing: ``doc["values"]["prefixd_opens_total"]`` or
    ``doc["pools"][model_id]["cache"]["opens"]``.
    """
    doc = json.loads(reply.json) if reply.json else {}
    if not isinstance(doc, dict):
        doc = {"detail": doc}
    doc.setdefault("values", dict(sorted(reply.values.items())))
    return json.dumps(doc, indent=2, sort_keys=True)


def lookup_text(reply: pb.LookupReply, num_tokens: int, model_id: str) -> str:
    """``cached 64 of 74 tokens (model m), by best tier: device 48, host 16, disk 0``.

    The tiers count every matched token once, at the best tier holding it; unverified tokens
    (disk blocks a recovery found and no one has checked yet) are matched but not yet a sure hit.
    """
    text = (f"cached {reply.cached_tokens} of {num_tokens} tokens (model {model_id}), by best "
            f"tier: device {reply.device_tokens}, host {reply.host_tokens}, disk {reply.disk_tokens}")
    if reply.unverified_tokens:
        text += (f"; {reply.unverified_tokens} more on disk not checked yet (an open checks "
                 f"and serves them)")
    return text
