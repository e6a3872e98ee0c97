"""The product carries no test hooks: a test injects its fault through its own entry point
(``tests/daemon/launcher.py`` wraps the daemon's ``main``), never through an environment
variable the daemon reads."""

import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "prefixd")


def test_no_prefixd_test_variable_in_the_package():
    found = []
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith((".py", ".pyi", ".toml", ".service", ".md")):
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    found += [f"{os.path.relpath(path, PACKAGE)}:{i}" for i, line in enumerate(f, 1)
                              if "PREFIXD_TEST_" in line]
    assert not found, f"test hooks in the product (inject them from the test instead): {found}"
