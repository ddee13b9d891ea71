"""Shared by the engine tests (marked ``vllm``): the vLLM Python they run their checks under."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_engine import VLLM


@pytest.fixture(scope="session")
def vllm_python(tmp_path_factory) -> Path:
    """The vLLM venv's Python (tests/export/vllm_engine.py) as the checks run it, at one ``import vllm`` a session:
    a stub whose every run is a fresh process forked from a server that imported vLLM once
    (tests/export/vllm_warm.py). Only for tests marked ``needs_vllm`` (they skip first where there is no vLLM)."""
    import vllm_warm

    stub, server = vllm_warm.start(VLLM, tmp_path_factory.mktemp("vllm-server"))
    yield stub
    server.kill()
    server.wait()
