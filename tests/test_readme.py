"""The README's configuration sample is one the engine accepts (a newcomer copies it first)."""

import pathlib
import re

from prefixd.engine import EngineConfig, Tenant

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_toml_sample_loads():
    samples = re.findall(r"```toml\n(.*?)```", README.read_text(), re.S)
    assert samples, "the README shows no TOML sample"
    for sample in samples:
        config = EngineConfig.from_toml(sample.encode())
        assert config.tenants == (Tenant("acme", "acme-2026"),)
        assert config.blocks.as_tuple() == (4096, 16384, 65536)
