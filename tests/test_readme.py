"""The README's examples run as written, on CPU, and print what their comments say.

Every fenced ```python block of README.md runs on its own, in a fresh namespace (a block must not
depend on an earlier one), with ``torch.cuda.is_available()`` reporting False so that the examples
take their CPU branch. Every ``print(...)`` statement must be a top-level statement and document
its output: either in a trailing comment on the line where the call ends
(``print(x)  # 134 3.82x``) or in comment lines right below it (``# (16, 8, 134) uint8 ...``).
The printed lines must equal those comments exactly, so the README cannot drift.

Under ``TRITON_INTERPRET=1`` the torch examples run the Triton kernels in the interpreter;
without it they run the NumPy oracles. The comments hold for both: the blocks run in-process in
the suite's mode, and once more in a subprocess with the other mode.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path
from unittest import mock

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def _python_blocks() -> list[tuple[int, str]]:
    """``(first line number in README.md, source)`` of every ```python block."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in _FENCE.finditer(text)]


def _is_print(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print")


def expected_output(source: str) -> list[str]:
    """The documented output of ``source``: one entry per top-level ``print`` statement, taken
    from the trailing comment of its last line, else from the comment-only lines right below it."""
    tree = ast.parse(source)
    prints = [n for n in tree.body if isinstance(n, ast.Expr) and _is_print(n.value)]
    nested = [n for n in ast.walk(tree) if _is_print(n)]
    if len(nested) != len(prints):
        raise AssertionError("every print in a README block must be a top-level statement (one line of output each)")
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text after '# ', comment-only line)
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            only = lines[row - 1].strip().startswith("#")
            comments[row] = (tok.string[1:].strip(), only)
    expected = []
    for node in prints:
        end = node.end_lineno
        if end in comments and not comments[end][1]:
            expected.append(comments[end][0])
            continue
        block = []
        row = end + 1
        while row in comments and comments[row][1]:
            block.append(comments[row][0])
            row += 1
        if not block:
            raise AssertionError(f"the print ending on block line {end} documents no output "
                                 f"(add a trailing '# <output>' comment)")
        expected.append("\n".join(block))
    return expected


BLOCKS = _python_blocks()


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2, "README.md should hold the oracle and the torch examples"


def run_block(first_line: int, source: str) -> list[str]:
    """Run one block in a fresh namespace with CUDA reported unavailable; its printed lines."""
    buf = io.StringIO()
    code = compile(source, f"README.md:{first_line}", "exec")
    with contextlib.ExitStack() as stack:
        if "torch" in source:
            import torch

            stack.enter_context(mock.patch.object(torch.cuda, "is_available", lambda: False))
        stack.enter_context(contextlib.redirect_stdout(buf))
        exec(code, {"__name__": "__readme__"})
    return buf.getvalue().splitlines()


def check_block(first_line: int, source: str) -> None:
    expected = "\n".join(expected_output(source)).splitlines()
    printed = run_block(first_line, source)
    assert printed == expected, f"README.md:{first_line}: printed {printed}, the comments say {expected}"


@pytest.mark.parametrize("first_line, source", BLOCKS, ids=[f"README.md:{n}" for n, _ in BLOCKS])
def test_readme_block_runs_and_prints_its_comments(first_line, source):
    if "torch" in source:
        pytest.importorskip("torch")
    check_block(first_line, source)


def test_readme_blocks_in_the_other_cpu_mode():
    """The same check with TRITON_INTERPRET flipped (it takes effect at import), in a fresh
    interpreter: CI runs the suite under TRITON_INTERPRET=1, and this covers the NumPy-oracle
    fallback there (and the interpreter when the suite runs without it)."""
    pytest.importorskip("torch")
    env = dict(os.environ)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env.pop("TRITON_INTERPRET")
    else:
        env["TRITON_INTERPRET"] = "1"
    root = README.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    code = ("from tests.test_readme import BLOCKS, check_block\n"
            "for first_line, source in BLOCKS:\n"
            "    check_block(first_line, source)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]


def test_expected_output_parser():
    src = (
        "x = 1  # not output\n"
        "print(1)  # 1\n"
        "print(2,\n"
        "      3)  # 2 3\n"
        "print('a')\n"
        "# a\n"
        "y = 2\n"
    )
    assert expected_output(src) == ["1", "2 3", "a"]
    with pytest.raises(AssertionError, match="documents no output"):
        expected_output("print(1)\n")
    with pytest.raises(AssertionError, match="top-level"):
        expected_output("for i in range(2):\n    print(i)  # 0\n")
