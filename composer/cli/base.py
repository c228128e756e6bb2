"""What every ``composer`` subcommand shares: the usage error and the parser that raises it."""

from __future__ import annotations

import argparse
from typing import NoReturn

DEFAULT_PATTERN = "M-M*-ME"


class UsageError(Exception):
    """A user mistake: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")
