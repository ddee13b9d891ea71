"""Which errors are the user's to fix: said in one line (``autoprec <command>: error: ...``), never a traceback.

A property of the error types, defined here, at the bottom of the stack, so that every layer can raise and
recognise them without reaching up into the CLI: an error is the user's when it is a :class:`UserError`
(a problem in model.py, a bad command line) or a ``ValueError``, autoprec's way of refusing a bad input
(``PolicyError``, ``BudgetError``, ``StorageError``... derive from it, and every plain ``raise ValueError``
in autoprec names a bad input and its fix). Anything else is a bug and keeps its traceback;
``AUTOPREC_DEBUG=1`` shows the traceback of a user error too.
"""

from __future__ import annotations

__all__ = ["USER_ERRORS", "Terminated", "UserError", "is_users"]


class UserError(Exception):
    """An error in what the user gave (a file, a command line) rather than in autoprec: one line, no traceback."""


# The types whose instances are the user's: for ``except USER_ERRORS:``.
USER_ERRORS: tuple[type[Exception], ...] = (UserError, ValueError)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, or torchrun ending the job): the run stops as on Ctrl-C and says what it kept."""


def is_users(error: BaseException) -> bool:
    """Whether ``error`` is the user's to fix (said in one line), not a bug in autoprec."""
    return isinstance(error, USER_ERRORS)
