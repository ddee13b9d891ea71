"""The pipeline reads in small pieces: no function in the package is over 80 lines, and each stage's entry takes
(the workload, what the stage before produced, its own config, the run context) and little else.

``python benchmarks/longest_functions.py`` lists the longest functions."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import autoprec

PACKAGE = Path(autoprec.__file__).parent
MOST_LINES = 80
MOST_PARAMETERS = 6


def test_no_function_is_over_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - first + 1 > MOST_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} "
                                f"({node.end_lineno - first + 1} lines)")
    assert not long, f"split these along what they do: {long}"


def test_each_stage_entry_takes_its_config_and_the_run_context():
    from autoprec.outputs.report import write_outputs
    from autoprec.profile import profile_layers
    from autoprec.profile.reuse import load_or_profile
    from autoprec.profile.training import profile_training_layers
    from autoprec.search.stage import search_workload
    from autoprec.search.study import run_search
    from autoprec.verify.end_to_end import verify_candidates
    from autoprec.verify.stage import fp32_answer, verify_search
    from autoprec.workloads import Workload

    stages = [load_or_profile, profile_layers, profile_training_layers, Workload.profile, run_search, search_workload,
              verify_candidates, verify_search, fp32_answer, write_outputs]
    for stage in stages:
        parameters = [p for p in inspect.signature(stage).parameters if p != "self"]
        assert len(parameters) <= MOST_PARAMETERS, f"{stage.__qualname__}{inspect.signature(stage)}"
    for stage in stages[:-1]:
        assert list(inspect.signature(stage).parameters)[-2:] in (["config", "context"], ["context", "timed"]), \
            f"{stage.__qualname__}{inspect.signature(stage)}"
