"""bench.py and bench_train.py without CUDA."""

from pathlib import Path

import pytest
import torch

from conftest import run_cli


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("script", ["benchmarks/bench.py", "benchmarks/bench_train.py"])
def test_benchmarks_without_cuda_say_so_in_one_line(script):
    """The GPU benchmarks on a machine without CUDA end in one `error:` line, exit code 2."""
    result = run_cli(script=script)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"error: {Path(script).name} times CUDA kernels: no CUDA device here"
