"""The N longest functions of the autoprec package (lines from ``def`` to the last line of the body), by ast.

    python benchmarks/longest_functions.py [N]      # default 15

A nested function counts inside its parent and again on its own line. ``tests/project/test_function_length.py``
holds the pipeline's packages to at most 80 lines a function.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "autoprec"


def function_lengths(root: Path = PACKAGE) -> list[tuple[int, str, str]]:
    """(lines, dotted module, function name) for every function in every module under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                found.append((node.end_lineno - first + 1, module, node.name))
    return sorted(found, key=lambda f: (-f[0], f[1], f[2]))


def main(argv: list[str]) -> int:
    count = int(argv[0]) if argv else 15
    for lines, module, name in function_lengths()[:count]:
        print(f"{lines:5d}  {module}.{name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
