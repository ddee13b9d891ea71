"""What an install ships: every package of autoprec is listed for setuptools (a package missing from the
list imports from a checkout or an editable install and is absent from a wheel, so `autoprec` breaks
only for users who pip install it)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_under_autoprec_is_installed():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import pytest

        tomllib = pytest.importorskip("tomli")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "autoprec").rglob("__init__.py")}
    assert found - listed == set(), f"add to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"
