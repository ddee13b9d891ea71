"""Third-party log lines that say nothing to an autoprec user, kept off the terminal.

Each filter names one logger and one message, so everything else those libraries log (a real problem)
still prints. They are logging records, not ``warnings``: torchao logs its optional GPU kernels that a
CPU machine cannot load, and torch's pytree logs a deprecation addressed to torchao's authors.
"""

from __future__ import annotations

import logging
import re

__all__ = ["NOISE", "quiet_third_party"]

# logger name -> what its uninformative message looks like
NOISE: dict[str, re.Pattern[str]] = {
    # torchao/__init__.py, on a machine without the CUDA libraries its prebuilt kernels link against
    "torchao": re.compile(r"^Failed to load .*\.so\b"),
    # torch/utils/_pytree.py: torchao registers Enums as pytree constants, which torch now deprecates
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),
}


class _Drop(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to hide
            return True
        return not self.pattern.search(message)


def quiet_third_party() -> None:
    """Drop the :data:`NOISE` messages from their loggers (once per process)."""
    for name, pattern in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(pattern))
