"""README.md: its Python runs as printed, and its test command is the one CI runs."""
import importlib.util
import re
import subprocess
import sys

import pytest

from conftest import HERE


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (HERE / "README.md").read_text(), re.S)


def engine_missing(block: str) -> str | None:
    """The serving engine a block imports, where it is not installed here (none is)."""
    engines = set(re.findall(r"^\s*(?:from|import) (tensorrt_llm|vllm|sglang)\b", block, re.M))
    return next((e for e in sorted(engines) if importlib.util.find_spec(e) is None), None)


def test_readme_python_blocks_compile():
    """Every Python block of the README is valid Python."""
    blocks = python_blocks()
    assert blocks
    for block in blocks:
        compile(block, "README.md", "exec")


@pytest.mark.package
def test_readme_python_blocks_run_as_printed():
    """The README's Python blocks, in order, as one script in a fresh process from the repository root, run
    on the default pair and print the answer and its τ. A block that needs a serving engine not installed
    here (TensorRT-LLM) is only compiled (test_readme_python_blocks_compile)."""
    runnable = [block for block in python_blocks() if engine_missing(block) is None]
    assert len(runnable) >= 2
    result = subprocess.run([sys.executable, "-c", "\n".join(runnable)], capture_output=True, text=True, cwd=HERE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^tau \d+\.\d\d ", result.stdout, re.M), result.stdout


def test_readme_test_command_is_what_ci_runs():
    """CI installs as the README says, line for line, then runs the README's test command."""
    readme, ci = (HERE / "README.md").read_text(), (HERE / ".ci" / "run").read_text()
    assert "python -m pytest -q" in readme and "python -m pytest -q" in ci
    installs = re.findall(r"^pip install -q (.+)$", ci, re.M)
    assert len(installs) >= 4
    for install in installs:
        assert f"pip install {install}" in readme, install
