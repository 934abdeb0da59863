"""Placeholder replaced below."""
from __future__ import annotations

import argparse


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    return 0
