"""The CUDA ops' Python glue on the CPU: argument checks, metadata, tile offsets and launch parameters.

CudaOps prepares every launch as on a GPU, under torch.inference_mode() as the worker runs it, and
cuda_emulation.EmulatedLauncher executes each launch in PyTorch from its grid and arguments. So a launch
prepared wrongly, or glue that fails on the worker's inference tensors, fails here, in every `make test`;
tests/test_kernels_cuda.py runs the kernels themselves where a GPU is.
"""

from __future__ import annotations

import math

import pytest
import torch
from cuda_emulation import EmulatedLauncher
from worker_testing import drive_greedy, hf_greedy, load_hf, make_runner, save_tiny_llama

from pagedserve.kernels import cuda_ops
from pagedserve.kernels.cuda_ops import CudaOps
from pagedserve.kernels.reference import ReferenceOps
from pagedserve.worker_svc.cuda_graphs import EagerCapture, capture_sizes

CPU = torch.device("cpu")
REFERENCE = ReferenceOps()
TOL = {torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-5, 1e-5)}


@pytest.fixture
def launcher() -> EmulatedLauncher:
    return EmulatedLauncher()


@pytest.fixture
def ops(launcher) -> CudaOps:
    return CudaOps(CPU, launcher)


class Paged:
    """A batch of sequences written (by the reference) at scattered block ids of a NaN-poisoned cache."""

    def __init__(self, lens, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.bs, self.hkv, self.d, self.dtype = block_size, num_kv_heads, head_size, dtype
        blocks = [math.ceil(n / block_size) for n in lens]
        num_blocks = 2 * sum(blocks) + 4
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        self.k = torch.full(shape, math.nan, dtype=dtype)
        self.v = torch.full(shape, math.nan, dtype=dtype)
        perm = torch.randperm(num_blocks, generator=self.gen).tolist()
        # Past its blocks, a sequence's table points at a block nothing writes (NaN): a launch that reads
        # past a sequence's blocks shows it.
        pad, used = perm[: len(lens)], iter(perm[len(lens) :])
        self.tables = torch.tensor(
            [[pad[s]] * (max(blocks) + 2) for s in range(len(lens))], dtype=torch.int32
        )
        for s, n in enumerate(blocks):
            self.tables[s, :n] = torch.tensor([next(used) for _ in range(n)], dtype=torch.int32)
        self.lens = torch.tensor(lens, dtype=torch.int32)
        for s, n in enumerate(lens):
            pos = torch.arange(n)
            slots = self.tables[s, pos // block_size].long() * block_size + pos % block_size
            key = torch.randn(n, num_kv_heads, head_size, generator=self.gen).to(dtype)
            value = torch.randn(n, num_kv_heads, head_size, generator=self.gen).to(dtype)
            REFERENCE.write_kv(key, value, self.k, self.v, slots)

    def query(self, rows: int, num_q_heads: int) -> torch.Tensor:
        return torch.randn(rows, num_q_heads, self.d, generator=self.gen).to(self.dtype)


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOL[expected.dtype]
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=atol)


# ---- the cache ops ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_from_a_slice_of_the_fused_projection_skips_padding(ops, dtype):
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        qkv = torch.randn(5, (4 + 2 + 2) * 64, generator=gen).to(dtype)  # q, k, v of 5 tokens side by side
        key = qkv[:, 256:384].view(5, 2, 64)
        value = qkv[:, 384:].view(5, 2, 64)
        slots = torch.tensor([3, 17, -1, 40, 0])  # -1: a padding row, written nowhere
        got = [torch.zeros(4, 16, 2, 64, dtype=dtype) for _ in range(2)]
        ops.write_kv(key, value, *got, slots)
    expected = [torch.zeros(4, 16, 2, 64, dtype=dtype) for _ in range(2)]
    keep = slots >= 0
    REFERENCE.write_kv(key[keep], value[keep], *expected, slots[keep])
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_copy_blocks_behave_as_copies_in_order(ops, launcher):
    gen = torch.Generator().manual_seed(2)
    caches = [torch.randn(8, 16, 2, 64, generator=gen) for _ in range(4)]
    expected = [c.clone() for c in caches]
    # 1 -> 2 then 2 -> 5: the second copy reads what the first wrote, so they go in two launches.
    src, dst = torch.tensor([1, 2, 6]), torch.tensor([2, 5, 7])
    with torch.inference_mode():
        ops.copy_blocks(caches[:2], caches[2:], src, dst)
    REFERENCE.copy_blocks(expected[:2], expected[2:], src, dst)
    assert all(torch.equal(c, e) for c, e in zip(caches, expected, strict=True))
    assert [name for name, _ in launcher.launches] == ["copy_blocks_u16", "copy_blocks_u16"]


# ---- attention --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (8, 2), (12, 2), (16, 1)])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_matches_the_reference_with_and_without_splits(
    ops, launcher, dtype, num_q_heads, num_kv_heads, num_splits
):
    # Groups of 1, 4, 6 (two CTAs of 4 heads, the second one short) and 16 heads; contexts ending inside,
    # at and just past a block, and one long enough to split.
    cache = Paged([1, 15, 16, 17, 100], num_kv_heads=num_kv_heads, dtype=dtype)
    with torch.inference_mode():
        query = cache.query(5, num_q_heads)
        got = ops.paged_decode_attention_splits(
            query, cache.k, cache.v, cache.tables, cache.lens, 0.125, num_splits
        )
    expected = REFERENCE.paged_decode_attention(query, cache.k, cache.v, cache.tables, cache.lens, 0.125)
    assert_close(got, expected)
    merged = [name for name, _ in launcher.launches if name.startswith("merge_splits")]
    assert len(merged) == (1 if num_splits == 3 else 0)


def test_a_long_context_on_few_multiprocessors_splits_and_merges():
    launcher = EmulatedLauncher(num_sms=2)
    ops = CudaOps(CPU, launcher)
    cache = Paged([1100, 40], num_kv_heads=1)
    with torch.inference_mode():
        query = cache.query(2, 2)
        got = ops.paged_decode_attention(query, cache.k, cache.v, cache.tables, cache.lens, 0.125)
    assert_close(
        got, REFERENCE.paged_decode_attention(query, cache.k, cache.v, cache.tables, cache.lens, 0.125)
    )
    (decode_grid,) = [grid for name, grid in launcher.launches if name.startswith("paged_decode")]
    assert decode_grid[2] > 1 and launcher.launches[-1][0] == "merge_splits_fp32"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (8, 2), (14, 2)])
def test_a_mixed_step_matches_the_reference(ops, dtype, num_q_heads, num_kv_heads):
    # A step as the worker builds it: decode rows (1 query), a chunk after cached context, and whole prompts
    # whose tiles end inside a sequence.
    lens, q_lens = [40, 33, 7, 70, 1], [1, 9, 7, 23, 1]
    cache = Paged(lens, num_kv_heads=num_kv_heads, dtype=dtype)
    with torch.inference_mode():
        query = cache.query(sum(q_lens), num_q_heads)
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        got = ops.paged_prefill_attention(query, cache.k, cache.v, cache.tables, starts, cache.lens, 0.125)
    expected = REFERENCE.paged_prefill_attention(
        query, cache.k, cache.v, cache.tables, starts, cache.lens, 0.125
    )
    assert_close(got, expected)


def test_each_steps_tile_offsets_come_from_its_own_metadata(ops):
    # The tile offsets are remembered per metadata tensor: the next step's fresh tensors (inference tensors,
    # which keep no version counter) get their own, and a tensor changed in place outside inference mode is
    # read again.
    cache = Paged([30, 30, 30])
    for q_lens in ([30, 1, 1], [1, 1, 30], [10, 10, 10]):
        with torch.inference_mode():
            query = cache.query(sum(q_lens), 4)
            starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
            lens = torch.tensor([30, 30, 30], dtype=torch.int32)
            got = ops.paged_prefill_attention(query, cache.k, cache.v, cache.tables, starts, lens, 0.125)
        assert_close(
            got, REFERENCE.paged_prefill_attention(query, cache.k, cache.v, cache.tables, starts, lens, 0.125)
        )
    starts = torch.tensor([0, 30, 31, 32], dtype=torch.int32)
    query = cache.query(32, 4)
    ops.paged_prefill_attention(query, cache.k, cache.v, cache.tables, starts, cache.lens, 0.125)
    starts.copy_(torch.tensor([0, 1, 2, 32], dtype=torch.int32))
    got = ops.paged_prefill_attention(query, cache.k, cache.v, cache.tables, starts, cache.lens, 0.125)
    assert_close(
        got,
        REFERENCE.paged_prefill_attention(query, cache.k, cache.v, cache.tables, starts, cache.lens, 0.125),
    )


@pytest.mark.parametrize(
    ("head_size", "block_size", "dtype", "message"),
    [
        (48, 16, torch.float32, "head sizes"),
        (64, 4, torch.float32, "block sizes"),
        (64, 16, torch.float64, "support"),
    ],
)
def test_shapes_the_kernels_lack_are_refused_by_name(ops, head_size, block_size, dtype, message):
    cache = torch.zeros(4, block_size, 1, head_size, dtype=dtype)
    query = torch.zeros(1, 1, head_size, dtype=dtype)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=message):
        ops.paged_decode_attention(query, cache, cache, tables, lens, 1.0)
    assert cuda_ops.unsupported_reason(head_size, block_size, dtype) is not None


# ---- a model on the CUDA ops ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama64(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-64"), head_dim=64)


def test_the_runner_on_the_cuda_ops_decodes_as_transformers(llama64, launcher):
    # The worker's runner through CudaOps (its forward pass under inference mode, its metadata built per
    # step): chunked prefill, a mixed step and decode steps, greedy tokens against transformers' own.
    runner = make_runner(llama64, num_blocks=16, block_size=16, ops=CudaOps(CPU, launcher))
    prompts = [[5, 17, 42, 9, 77, 3, 61, 90, 12, 33, 2, 8, 19, 4, 66, 70, 71, 13], [7, 8, 9]]
    sampled = drive_greedy(runner, prompts, block_size=16, steps=12)
    hf_model = load_hf(llama64)
    assert sampled == [
        hf_greedy(hf_model, prompt, len(tokens)) for prompt, tokens in zip(prompts, sampled, strict=True)
    ]
    assert [len(tokens) for tokens in sampled] == [11, 11]
    kernels = {name.split("_")[0] + "_" + name.split("_")[1] for name, _ in launcher.launches}
    assert {"write_kv", "paged_prefill", "paged_decode"} <= kernels


# ---- a worker on CUDA: what is decided before anything runs ----------------------------------------


def test_a_shape_the_kernels_lack_is_refused_at_load_by_name(ops):
    from pagedserve.worker_svc.assembly import check_kernel_shapes

    check_kernel_shapes(ops, 128, 16, torch.bfloat16)
    with pytest.raises(ValueError, match=r"cannot run on cuda: CUDA kernels support head sizes .* not 16"):
        check_kernel_shapes(ops, 16, 16, torch.bfloat16)  # the test Llama's head size
    with pytest.raises(ValueError, match=r"block sizes .* not 64"):
        check_kernel_shapes(ops, 128, 64, torch.bfloat16)
    check_kernel_shapes(REFERENCE, 16, 64, torch.float64)  # the reference runs any shape


def test_the_kv_pool_takes_the_share_of_the_gpu_the_weights_and_activations_leave():
    from pagedserve.worker_svc.kv_cache import cuda_kv_budget

    gib = 1024**3
    # An 80 GiB device, 16 GiB of weights loaded, 2 GiB of activations: 0.9 x 80 - 16 - 2.
    assert cuda_kv_budget(80 * gib, 63 * gib, 16 * gib, 0.9, 2 * gib) == int(0.9 * 80 * gib) - 18 * gib
    # Another process holds 30 GiB: no more than what is free beyond the activations.
    assert cuda_kv_budget(80 * gib, 33 * gib, 16 * gib, 0.9, 2 * gib) == 31 * gib
    with pytest.raises(ValueError, match=r"gpu-memory-utilization 0\.2 of 80\.0 GiB leaves no room"):
        cuda_kv_budget(80 * gib, 63 * gib, 16 * gib, 0.2, 2 * gib)


def test_the_worker_takes_gpu_memory_utilization_in_range():
    from pagedserve.worker_svc.config import WorkerConfig

    assert WorkerConfig.from_args([], env={}).gpu_memory_utilization == 0.9
    assert (
        WorkerConfig.from_args([], env={"PAGEDSERVE_GPU_MEMORY_UTILIZATION": "0.5"}).gpu_memory_utilization
        == 0.5
    )
    for bad in ("0", "1.5"):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            WorkerConfig.from_args(["--gpu-memory-utilization", bad], env={})


def test_serve_spreads_cuda_workers_over_the_gpus_and_splits_a_shared_ones_memory(monkeypatch):
    from pagedserve import launcher

    def workers(gpus: int, *argv: str) -> list[tuple[str, str | None]]:
        monkeypatch.setattr(launcher, "_cuda_device_count", lambda: gpus)
        config = launcher.LaunchConfig(**vars(launcher.build_parser().parse_args(argv)))
        out = []
        for args in launcher._child_args(config, "/m", "127.0.0.1:1", 1)[1]:
            flag = "--gpu-memory-utilization"
            out.append(
                (args[args.index("--device") + 1], args[args.index(flag) + 1] if flag in args else None)
            )
        return out

    assert workers(2, "--workers", "4", "--device", "cuda") == [
        ("cuda:0", "0.45"),
        ("cuda:1", "0.45"),
        ("cuda:0", "0.45"),
        ("cuda:1", "0.45"),
    ]
    assert workers(2, "--workers", "3", "--device", "cuda", "--gpu-memory-utilization", "0.8") == [
        ("cuda:0", "0.4"),
        ("cuda:1", "0.8"),
        ("cuda:0", "0.4"),
    ]
    assert workers(1, "--workers", "2") == [("cuda:0", "0.45"), ("cuda:0", "0.45")]  # auto, a GPU seen
    assert workers(0, "--workers", "2") == [("auto", None), ("auto", None)]  # auto, none: the CPU
    assert workers(4, "--workers", "2", "--device", "cuda:3") == [("cuda:3", "0.45"), ("cuda:3", "0.45")]
    assert workers(4, "--device", "cuda:3") == [("cuda:3", "0.9")]
    assert workers(4, "--device", "cpu") == [("cpu", None)]


# ---- CUDA graphs: the captured decode steps, replayed ------------------------------------------------


class CountingCapture(EagerCapture):
    """EagerCapture that counts the captures and the replays of each."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replays = 0

    def capture(self, step):
        self.captured.append(len(self.captured))

        def replay():
            self.replays += 1
            return step()

        return replay


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_decode_steps_replayed_from_captured_graphs_decode_as_transformers(llama64, launcher):
    # The runner on the CUDA ops with its plain decode steps replayed (padded to 4 rows from 2, the rows past
    # them written nowhere): the same greedy tokens as transformers, and every decode step a replay.
    runner = make_runner(llama64, num_blocks=16, block_size=16, ops=CudaOps(CPU, launcher))
    capture = CountingCapture()
    with torch.inference_mode():
        runner.capture_decode_graphs([1, 4], capture)
    assert len(capture.captured) == 2
    before = [t.clone() for pair in runner.kv_cache.layers for t in pair]
    assert all(t.eq(0).all() for t in before), "capturing wrote into the KV pool"
    prompts = [[5, 17, 42, 9, 77, 3, 61, 90, 12, 33, 2, 8, 19, 4, 66, 70, 71, 13], [7, 8, 9]]
    sampled = drive_greedy(runner, prompts, block_size=16, steps=12)
    hf_model = load_hf(llama64)
    assert sampled == [hf_greedy(hf_model, p, len(t)) for p, t in zip(prompts, sampled, strict=True)]
    assert capture.replays == 10  # steps 3..12 are plain decode steps of two sequences


def test_a_batch_larger_than_every_captured_size_runs_eagerly(llama64, launcher):
    runner = make_runner(llama64, num_blocks=16, block_size=16, ops=CudaOps(CPU, launcher))
    capture = CountingCapture()
    with torch.inference_mode():
        runner.capture_decode_graphs([1], capture)
    prompts = [[5, 17, 42, 9], [7, 8, 9]]
    sampled = drive_greedy(runner, prompts, block_size=16, steps=5)
    hf_model = load_hf(llama64)
    assert sampled == [hf_greedy(hf_model, p, len(t)) for p, t in zip(prompts, sampled, strict=True)]
    assert capture.replays == 0
