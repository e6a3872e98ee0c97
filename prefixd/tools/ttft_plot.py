"""A PNG of time to first token per request, with and without prefixd, the restart marked.

Used by ``bench/e2e.py`` (``docs/bench/e2e_ttft.png``) and ``make demo``. Needs matplotlib
(the ``hf`` extra); it draws off-screen (Agg), so it works on a host without a display.
"""

from __future__ import annotations

import pathlib

KIND_STYLE = {  # kind -> (marker, colour, label)
    "cold": ("s", "tab:red", "prefixd, cold (prefix not cached yet)"),
    "warm": ("o", "tab:green", "prefixd, warm"),
    "after_restart": ("D", "tab:purple", "prefixd, first after kill -9 + restart"),
}


def plot_ttft(rows: list[dict], restart_after: int | None, path: str | pathlib.Path, title: str) -> pathlib.Path:
    """Write the plot; returns its path.

    Args:
        rows: one dict per request in the order served, with ``kind`` (a ``KIND_STYLE`` key),
            ``ttft_ms`` (through prefixd) and ``ttft_no_cache_ms``.
        restart_after: the number of requests served before the daemon was killed (None: no
            restart in the run).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    xs = list(range(1, len(rows) + 1))
    fig, ax = plt.subplots(figsize=(9, 5.2), dpi=110)
    ax.plot(xs, [r["ttft_no_cache_ms"] for r in rows], "x-", color="tab:gray", lw=1,
            label="transformers' own cache (no reuse)")
    for kind, (marker, colour, label) in KIND_STYLE.items():
        pts = [(x, r["ttft_ms"]) for x, r in zip(xs, rows) if r["kind"] == kind]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, color=colour, ls="none", label=label)
    ax.plot(xs, [r["ttft_ms"] for r in rows], "-", color="tab:green", lw=0.6, alpha=0.5)
    if restart_after is not None:
        ax.axvline(restart_after + 0.5, color="black", ls="--", lw=1)
        ax.annotate("daemon kill -9\n+ restart", (restart_after + 0.6, ax.get_ylim()[1] * 0.9),
                    fontsize=8, va="top")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("request (in the order served)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
