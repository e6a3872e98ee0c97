"""The README works as written: its configuration samples (and those of docs/engine.md) load,
and a newcomer who runs the daemon, the "Attach from Python" snippet and ``prefixctl status``
gets what it says."""

import contextlib
import io
import json
import pathlib
import re

from prefixd.config import Tenant, load, read_engine_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ENGINE_DOC = ROOT / "docs" / "engine.md"  # the in-process engine's page, moved out of the README


def toml_samples(path: pathlib.Path) -> list[str]:
    return re.findall(r"```toml\n(.*?)```", path.read_text(), re.S)


def test_readme_toml_sample_loads():
    assert toml_samples(README), "the README shows no TOML sample"
    assert toml_samples(ENGINE_DOC), "docs/engine.md shows no TOML sample"
    for sample in toml_samples(README) + toml_samples(ENGINE_DOC):
        config = read_engine_config(sample.encode())
        if "[engine.cluster]" in sample:  # "Share prefixes across hosts"
            assert config.tenants == (Tenant("default", "same-on-every-host"),)
            assert config.cluster.nodes == ("10.0.0.1:7000", "10.0.0.2:7000")
            assert config.cluster.min_hits == 2
            continue
        assert config.cluster is None
        assert config.tenants == (Tenant("acme", "acme-2026"),)
        assert config.blocks.as_tuple() == (4096, 16384, 65536)


def section(title: str) -> str:
    """The README's text under ``## title``, up to the next ``## `` heading."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_readme_daemon_config_sample_loads(tmp_path):
    samples = [s for s in re.findall(r"```toml\n(.*?)```", README.read_text(), re.S) if "[daemon]" in s]
    assert samples, "the README shows no [daemon] sample"
    for i, sample in enumerate(samples):
        path = tmp_path / f"sample{i}.toml"
        path.write_text(sample)
        engine, daemon = load(str(path))
        assert daemon.lease_s == 10.0 and daemon.limits.blocks_per_tenant == 16777216
        (sock,) = daemon.socket_paths(engine, str(tmp_path))
        assert (sock.tenant, sock.path, sock.mode) == ("acme", "/run/prefixd/acme.sock", 0o660)


def test_readme_attach_snippet_and_prefixctl_status(monkeypatch):
    """What the README promises a newcomer: the snippet runs against a daemon, a second run
    hits the 6 full blocks, and ``prefixctl status`` (socket from $PREFIXD_SOCKET) lists the
    pool."""
    from prefixd.client import ctl
    from tests.daemon.harness import start_daemon

    (snippet,) = re.findall(r"```python\n(.*?)```", section("Attach from Python"), re.S)
    with start_daemon() as d:
        monkeypatch.setenv("PREFIXD_SOCKET", d.socket)
        outputs = []
        for _ in range(2):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(snippet, "README.md", "exec"), {"__name__": "readme"})
            outputs.append(out.getvalue())
        assert outputs == ["96 tokens cached, on mapped pool\n"] * 2
        stats = io.StringIO()
        with contextlib.redirect_stdout(stats):
            assert ctl.main(["stats", "--json"]) == 0
        assert json.loads(stats.getvalue())["values"]["prefixd_hit_tokens_total"] == 96  # 2nd open
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert ctl.main(["status"]) == 0
    assert "serving" in out.getvalue() and "tiny-llama  (layers=4 kv_heads=2 head_dim=64 float16" in out.getvalue()
    assert "device           6 / 256 blocks cached" in out.getvalue()
