"""The vLLM the engine tests run against: the check's own lookup (``--vllm-python``'s fallbacks:
$AUTOPREC_VLLM_PYTHON, else ``.venv-vllm/bin/python``), a ``.venv-vllm`` only once its build finished (.ci/run writes
``.venv-vllm/READY`` after it: the suite runs while it is built). $AUTOPREC_VLLM_PYTHON naming no file fails the
tests, never skips them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autoprec.export.judge import INSTALL_VLLM, find_vllm_python

__all__ = ["VLLM", "needs_vllm"]

ROOT = Path(__file__).parents[2]


def vllm_python() -> Path | None:
    found = find_vllm_python(root=ROOT)
    if found is not None and found.parent.parent.name == ".venv-vllm" and not os.environ.get("AUTOPREC_VLLM_PYTHON"):
        return found if (found.parent.parent / "READY").is_file() else None
    return found


VLLM = vllm_python()
needs_vllm = pytest.mark.skipif(VLLM is None, reason="no Python with vLLM: set AUTOPREC_VLLM_PYTHON, or build "
                                f"{INSTALL_VLLM} && touch .venv-vllm/READY")
