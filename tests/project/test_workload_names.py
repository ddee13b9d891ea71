"""A workload is one file: outside ``autoprec/workloads/`` nothing asks a workload's name or concrete type, and
a fourth workload plugs in with one module and one line in the registry (its options, its settings)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import autoprec
from autoprec.cli import build_parser, main
from autoprec.config import TuneConfig
from autoprec.workloads import registry
from autoprec.workloads.inference import InferenceWorkload

PACKAGE = Path(autoprec.__file__).parent
WORKLOADS = PACKAGE / "workloads"


def name_branches(source: str) -> list[str]:
    """Each comparison with a workload's name (``workload.name == ...``, ``for_ != "training"``) and each
    isinstance/issubclass check of a concrete workload class in ``source``, as ``line: code``."""
    names = set(registry.REGISTRY)
    classes = {where.split(":")[1] for where in registry.REGISTRY.values()}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            texts = [ast.unparse(o) for o in operands]
            of_a_name = any(isinstance(o, ast.Attribute) and o.attr in ("name", "workload")
                            and "workload" in ast.unparse(o.value).lower() for o in operands)
            literal = any(isinstance(o, ast.Constant) and o.value in names for o in operands)
            about = any("workload" in t.lower() or "for_" in t for t in texts)
            if of_a_name or (literal and about):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            if any(isinstance(n, ast.Name) and n.id in classes for n in ast.walk(node.args[1])):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_branch_on_a_workload_name_outside_workloads():
    found = {str(path.relative_to(PACKAGE.parent)): hits for path in sorted(PACKAGE.rglob("*.py"))
             if WORKLOADS not in path.parents and (hits := name_branches(path.read_text()))}
    assert not found, f"ask the workload object, not its name: {found}"


def test_the_scan_finds_what_it_looks_for():
    """The branches the pipeline had before the workloads answered for themselves."""
    assert len(name_branches("""
if workload.name != "inference": pass
check(training=workload.name == "training")
if args.for_ == "generation": pass
kind = "final loss" if isinstance(w, TrainingWorkload) else "metric"
""")) == 4
    assert not name_branches('if mode == "training": pass\nif isinstance(w, Workload): pass')  # apply modes


@dataclasses.dataclass
class EchoWorkload(InferenceWorkload):
    """A fourth workload, as a user would add one: this class and one registry line."""

    echo: int = 0

    name = "echo"
    tag = "echo"
    cli_help = "echo (inference, said twice)"
    cli_options = {"echo_level": "--echo-level is how loud the echo is"}
    notebook_settings = InferenceWorkload.notebook_settings | {"echo"}

    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument("--echo-level", type=int, default=None)

    @classmethod
    def from_notebook(cls, model, batches, evaluate, settings):
        return cls(model, list(batches), evaluate, echo=settings.get("echo", 0))


@pytest.fixture
def echo(monkeypatch):
    monkeypatch.setitem(registry.REGISTRY, "echo", f"{__name__}:EchoWorkload")


def test_a_fourth_workload_is_one_class_and_a_registry_line(echo, cli_models, capsys):
    args = build_parser().parse_args(["tune", "model.py", "--for", "echo", "--echo-level", "3"])
    assert (args.for_, args.echo_level) == ("echo", 3)
    assert main(["tune", "--help"]) == 0
    assert "or echo (inference, said twice)" in " ".join(capsys.readouterr().out.split())
    # its option with another --for is refused in one line, before the model loads
    assert main(["tune", str(cli_models / "mlp.py"), "--echo-level", "3"]) == 1
    assert "--echo-level is how loud the echo is: tune --for echo, or leave it out" in capsys.readouterr().err
    fields = {f.name for f in dataclasses.fields(TuneConfig)}
    assert registry.notebook_class("echo", {"echo", "trials"}, fields) is EchoWorkload
    with pytest.raises(TypeError, match="echo is a setting for tuning for echo, and this tune is for training"):
        registry.notebook_class("training", {"echo"}, fields)
    with pytest.raises(ValueError, match="for_ must be 'inference', 'training', 'generation' or 'echo', got 'x'"):
        registry.workload_class("x")


def test_generation_is_exported():
    from autoprec.workloads.generation import GenerationWorkload

    assert autoprec.GenerationWorkload is GenerationWorkload and "GenerationWorkload" in autoprec.__all__
