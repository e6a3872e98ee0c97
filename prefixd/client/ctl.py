"""The `prefixctl` command. Subcommands arrive with the daemon; today: --version."""

from __future__ import annotations

import argparse

import prefixd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixctl", description="inspect a prefixd daemon")
    parser.add_argument("--version", action="version", version=f"prefixctl {prefixd.__version__}")
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
