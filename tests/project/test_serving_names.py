"""One meaning per name (issue 46, item 4): each thing "serving" named has its own module, no module is plainly
``serving.py`` or package ``served/`` again, and ``workloads/`` holds only workloads."""

from __future__ import annotations

import ast
from pathlib import Path

import autoprec

PACKAGE = Path(autoprec.__file__).parent
# each meaning and where it lives (docs/architecture.md says the same in words)
HOMES = {
    "what serving a plan on a named GPU would take, estimated": "profile/serving_estimate.py",
    "the serving figures policy.json and the report give": "profile/serving_figures.py",
    "a policy applied with mode='serve'": "runtime/serve_mode.py",
    "a plan run as its engine serves it": "runtime/as_served.py",
    "the tune for a served mix": "served_mix/__init__.py",
    "the checkpoint an engine loads": "export/__init__.py",
}
VAGUE = {"serving.py", "served.py", "serve.py"}  # a name that says serving without saying which
VAGUE_PACKAGES = {"served", "serving", "serve"}
NOT_WORKLOADS = {"__init__.py", "base.py", "registry.py"}  # the contract and the registry beside the workloads


def vague_names(paths: list[Path]) -> list[str]:
    """The modules and packages among ``paths`` (relative to autoprec/) whose name says "serving" and not which."""
    return sorted(str(p) for p in paths if p.name in VAGUE or any(part in VAGUE_PACKAGES for part in p.parts[:-1]))


def defines_a_workload(source: str) -> bool:
    """Whether ``source`` defines a class whose bases name a Workload (``Workload``, ``InferenceWorkload``, ...)."""
    return any(isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Workload") for b in node.bases)
               for node in ast.walk(ast.parse(source)))


def test_each_serving_meaning_has_its_home():
    missing = {what: where for what, where in HOMES.items() if not (PACKAGE / where).is_file()}
    assert not missing, f"moved? update this test and docs/architecture.md: {missing}"


def test_no_module_says_serving_without_saying_which():
    paths = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")]
    assert vague_names(paths) == []
    # the check can fail: the names the package had before
    assert vague_names([Path("profile/serving.py"), Path("served/run.py"), Path("runtime/serve.py"),
                        Path("runtime/serve_mode.py")]) == ["profile/serving.py", "runtime/serve.py", "served/run.py"]


def test_workloads_holds_only_workloads():
    others = sorted(p.name for p in (PACKAGE / "workloads").glob("*.py")
                    if p.name not in NOT_WORKLOADS and not p.name.startswith("_")
                    and not defines_a_workload(p.read_text()))
    assert others == [], f"not a workload: move it to the stage it serves ({others})"
    # the check can fail: a module of helpers, as workloads/serving.py was, is found
    assert not defines_a_workload("def estimate(plan): ...\nclass Figures:\n    pass\n")
    assert defines_a_workload("class MineWorkload(InferenceWorkload):\n    pass\n")
