"""Without its framework, an integration says in one line what to install (the framework is hidden, not removed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module, hidden, hint", [
    ("autoprec.integrations.lightning", ["pytorch_lightning", "lightning"], 'pip install "autoprec[lightning]"'),
    ("autoprec.integrations.hf", ["transformers"], 'pip install "autoprec[hf]"'),
])
def test_missing_framework_is_one_line_with_the_install_hint(tmp_path, module, hidden, hint):
    for name in hidden:  # a package of that name that cannot be imported shadows the installed one
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError(\"No module named '{name}'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120,
                         env=env, check=False)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].startswith("ImportError: ") and hint in run.stderr.splitlines()[-1]
    assert "During handling" not in run.stderr  # the hint alone, not a chain of causes
