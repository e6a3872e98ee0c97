"""The committed gRPC modules match the proto (see ``prefixd/api/generate.py``)."""

from __future__ import annotations

import os

from prefixd.api import generate


def test_generated_modules_are_not_stale(tmp_path):
    """Editing prefixd.proto without running ``python -m prefixd.api.generate`` leaves the
    committed modules describing another API; this fails until they are regenerated."""
    here = os.path.dirname(generate.__file__)
    for name, fresh in generate.generate(str(tmp_path)).items():
        with open(os.path.join(here, name), "rb") as f:
            assert f.read() == fresh, f"{name} is stale: run python -m prefixd.api.generate"


def test_every_design_rpc_is_in_the_service():
    """DESIGN.md's API table names these rpcs; the service must have each one."""
    from prefixd.api import prefixd_pb2

    methods = set(prefixd_pb2.DESCRIPTOR.services_by_name["PrefixCache"].methods_by_name)
    wanted = {"Attach", "KeepAlive", "Detach", "Reclaim", "Lookup", "Open", "Extend", "Commit",
              "Fork", "Release", "WriteKV", "ReadKV", "Attend", "Stats", "SubscribeEvents"}
    assert wanted <= methods, wanted - methods
