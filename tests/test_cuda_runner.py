"""The worker's runner on a CUDA device: its greedy tokens equal the CPU runner's, in float32, on random
Llamas of the head sizes the CUDA kernels take. Runs where a CUDA device and a matching CuPy are present
(`make gpu-check`), skipped cleanly elsewhere."""

from __future__ import annotations

import pytest
from worker_testing import drive_greedy, make_runner, save_tiny_llama

from pagedserve.kernels import cuda_ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not cuda_ops.is_available(), reason="needs a CUDA device and a matching CuPy"),
]

PROMPTS = [
    [5, 17, 42, 9, 77, 3, 61, 90, 12, 33, 2, 8, 19, 4, 66, 70, 71, 13, 99, 100, 1, 2, 3],
    [7, 8, 9, 10],
]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_cuda_runner_decodes_as_the_cpu_runner(tmp_path, head_dim):
    model_dir = save_tiny_llama(tmp_path, head_dim=head_dim)
    cuda = make_runner(model_dir, num_blocks=32, block_size=16, device="cuda")
    assert cuda.model.ops.name == "cuda"
    cpu = make_runner(model_dir, num_blocks=32, block_size=16)
    assert drive_greedy(cuda, PROMPTS, 16, steps=24) == drive_greedy(cpu, PROMPTS, 16, steps=24)
