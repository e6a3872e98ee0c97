"""Regenerate ``prefixd_pb2.py`` and ``prefixd_pb2_grpc.py`` from ``prefixd.proto``.

NOTE: the generated modules are committed rather than built at install: an editable install,
a wheel and a checkout then all import the same code with no build step, and
``tests/api/test_generated.py`` fails when they are stale. After editing the proto run::

    python -m prefixd.api.generate
"""

from __future__ import annotations

import os
import sys
import tempfile

PROTO = "prefixd/api/prefixd.proto"
OUTPUTS = ("prefixd_pb2.py", "prefixd_pb2_grpc.py")


def package_root() -> str:
    """The directory that holds the ``prefixd`` package (the proto's import root)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def generate(out_dir: str) -> dict[str, bytes]:
    """Run protoc on the proto into ``out_dir``; returns each generated module's bytes.

    Raises:
        RuntimeError: protoc failed (its exit code is in the message).
    """
    from grpc_tools import protoc  # a build-time tool: only this module needs it

    root = package_root()
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    rc = protoc.main(["grpc_tools.protoc", f"-I{root}", f"-I{include}", f"--python_out={out_dir}",
                      f"--grpc_python_out={out_dir}", os.path.join(root, PROTO)])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc} on {PROTO}")
    gen = os.path.join(out_dir, "prefixd", "api")
    out = {}
    for name in OUTPUTS:
        with open(os.path.join(gen, name), "rb") as f:
            out[name] = f.read()
    return out


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in generate(tmp).items():
            with open(os.path.join(here, name), "wb") as f:
                f.write(data)
            print(f"wrote {os.path.join(here, name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
