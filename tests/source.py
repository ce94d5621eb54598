"""Python source as an AST for the tests that read the code (layers, rules), safe from a CPython 3.11 bug.

CPython 3.11.7 can fail `ast.parse` with `SystemError: AST constructor recursion depth mismatch` once an
earlier test in the same worker hit a RecursionError inside the AST code (python/cpython#106905, fixed in
later releases); the source is then parsed in a fresh interpreter instead, so the result never depends on
which tests ran before in that worker.
"""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys

_FRESH = "import ast, pickle, sys; sys.stdout.buffer.write(pickle.dumps(ast.parse(sys.stdin.read())))"


def parse(source: str) -> ast.Module:
    """`ast.parse(source)`, in a new interpreter when this one's AST state is broken."""
    try:
        return ast.parse(source)
    except SystemError:
        done = subprocess.run([sys.executable, "-c", _FRESH], input=source.encode(), capture_output=True,
                              check=True, timeout=60)
        tree = pickle.loads(done.stdout)
        assert isinstance(tree, ast.Module)
        return tree
