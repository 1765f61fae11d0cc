"""The `trl-vapo` command line."""

from __future__ import annotations

import argparse

from . import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trl-vapo", description="VAPO training for the Hugging Face TRL stack.")
    parser.add_argument("--version", action="version", version=f"trl-vapo {__version__}")
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
