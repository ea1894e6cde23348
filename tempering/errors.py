"""A user's mistakes, told apart from bugs.

`UserInputError` marks an error whose message already names the thing, the value and the
fix: a config key, a data file or row, a model path. Entry points (the example scripts, the
``tempering`` command) run inside :func:`exit_on_user_error`, which prints such an error as
one message without a traceback and exits with status 2. Anything else -- a bug, a dead
worker, an expired deadline -- keeps its traceback.

The concrete errors subclass both this and the builtin they always were (``ValueError``,
``FileNotFoundError``), so ``except ValueError`` around a loader still catches them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


class UserInputError(Exception):
    """A mistake in what the user gave; the message says what and how to fix it."""


class DataFileNotFoundError(FileNotFoundError, UserInputError):
    """A data, prompt or dataset path that does not exist."""


@contextmanager
def exit_on_user_error(what: str = "error") -> Iterator[None]:
    """Print a `UserInputError` as ``<what>: <message>`` on stderr and exit 2."""
    try:
        yield
    except UserInputError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
