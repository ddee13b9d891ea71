"""autoprec's import graph (benchmarks/imports.py reads it with ``ast``): no circle, no private name taken from
another module, and each layer imports only from below it (the CLI on top; the pipeline; the outputs; the
workloads; the stages; the distributed service; applying a policy; formats, the policy file and errors at the
bottom). Lazy imports inside functions count; the package root's re-exports and ``if TYPE_CHECKING:`` do not."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# the reader; the layers: autoprec/layering.py
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "imports.py"


@pytest.fixture(scope="module")
def graph():
    spec = importlib.util.spec_from_file_location("autoprec_imports", SCRIPT)
    imports = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = imports
    spec.loader.exec_module(imports)
    found = imports.imports(imports.modules())
    return imports, found, imports.module_edges(found)


def test_no_circle(graph):
    imports, _, edges = graph
    assert imports.cycles(edges) == []


def test_no_private_name_crosses_a_module(graph):
    imports, found, _ = graph
    assert imports.private_imports(found) == []


def test_each_layer_imports_only_from_below(graph):
    imports, _, edges = graph
    assert imports.upward_imports(edges) == []


def test_the_reader_sees_lazy_imports_and_skips_type_checking(graph, tmp_path):
    """The checks can fail: a lazy import that closes a circle and a private name are found, an import under
    TYPE_CHECKING is not."""
    imports, _, _ = graph
    package = tmp_path / "autoprec"
    package.mkdir()
    (package / "__init__.py").write_text("from .a import f\n")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
                                  "def f():\n    from .b import _g\n    return _g()\n")
    (package / "b.py").write_text("from . import a\ndef _g():\n    return 1\n")
    (package / "c.py").write_text("from .a import f\nclass C: ...\n")
    found = imports.imports(imports.modules(package))
    edges = imports.module_edges(found)
    assert imports.cycles(edges) == [["a", "b"]]
    assert imports.private_imports(found) == ["a <- b._g"]
    assert "c" not in edges["a"]


def test_user_errors_are_a_property_of_their_types():
    """Which errors are said in one line is defined once, at the bottom (autoprec.errors), not in the CLI."""
    from autoprec.cli.options import CommandError
    from autoprec.errors import UserError, is_users
    from autoprec.inputs.userspec import UserCodeError
    from autoprec.runtime.policy import PolicyError

    assert issubclass(CommandError, UserError) and issubclass(UserCodeError, UserError)
    assert is_users(PolicyError("x")) and is_users(ValueError("x")) and is_users(CommandError("x"))
    assert not is_users(RuntimeError("x")) and not is_users(KeyError("x"))


# What every layer needs of a model DDP, FSDP2 or torch.compile wrapped lives below them (common/wrapped.py), and
# apply_policy's path for one beside it (runtime/sharded.py, runtime/agree.py): the folders that name layers import
# nothing of distributed/, the processes of one tune, which sits above them.
BELOW_THE_PROCESSES = ("common", "inputs", "runtime", "capture")


def _reaching_up(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in edges.items() for t in targets
                  if m.split(".")[0] in BELOW_THE_PROCESSES and t.split(".")[0] == "distributed")


def test_wrapped_models_are_below_the_layers_that_name_layers(graph):
    _, _, edges = graph
    assert _reaching_up(edges) == []
    # the check can fail: the runtime importing distributed/ again is found, distributed/ importing inputs/ is not
    assert _reaching_up({"runtime.apply": {"distributed.agree"}, "distributed.tuning": {"inputs.userspec"}}) == [
        "runtime.apply -> distributed.agree"]
