"""The module fails at import time (a sibling module that is not there)."""

import helpers_that_do_not_exist  # noqa: F401
from torch import nn


def get_model():
    return nn.Linear(4, 2)
