"""Tensor parallelism on the CPU with gloo (worker_svc/parallel.py): a worker as a group of ranks, each a
process of its own, whose greedy float32 output equals one process's and transformers' own while requests
are batched; the shapes it refuses; a rank killed while streams are in flight under `pagedserve serve`.

The default model (SmolLM2-135M: 9 query heads, 3 kv heads) splits over 3 ranks, not 2; the tests run
TP=2 on small random Llamas with 4 query heads (2 kv heads split, 1 kv head replicated) and the default
model at TP=3.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from stack_testing import Stack, running, stream_completion, stream_marking_progress, wait_for
from transformers import LlamaConfig
from worker_testing import hf_greedy, load_hf, random_llama

from pagedserve import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from pagedserve.worker_svc.loader import read_model_config
from pagedserve.worker_svc.parallel import (
    EXIT_RANK_DIED,
    ParallelGroup,
    RankFailedError,
    check_tensor_parallel,
    rank_device,
    shard_config,
)

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
    "In a small village by the sea",
    "The best way to learn a language is",
    "Water boils at",
    "List three animals:",
    "My favourite book is",
    "import numpy as np",
    "The weather today",
    "Dear Sir or Madam,",
]
MAX_TOKENS = 24


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """A tensor-parallel engine gives rank 0 (this process) its share of the cores; the next test gets
    them back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def save_llama(
    path: Path,
    tokenizer_dir: Path,
    *,
    heads: int,
    kv_heads: int,
    vocab: int,
    bias: bool,
    tie: bool,
    hidden: int = 64,
    layers: int = 2,
    max_position: int = 512,
    seed: int = 0,
) -> Path:
    """A random float32 Llama of this shape (the norms near 1, the rest large enough that greedy text is
    not one token repeated), with the default model's tokenizer (its ids are below 49152: `vocab` may be
    larger, which leaves the last vocabulary shard padded)."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position,
        rms_norm_eps=1e-5,
        attention_bias=bias,
        mlp_bias=bias,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    random_llama(config, seed).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def split_kv_model(tmp_path_factory, default_model_dir) -> Path:
    """4 query heads, 2 kv heads (one per rank at TP=2), biases everywhere (the row-parallel ones added
    once), an LM head of its own, a vocabulary of 49155 rows (ranks of 24578, the last padded)."""
    path = tmp_path_factory.mktemp("tp-split")
    return save_llama(path, default_model_dir, heads=4, kv_heads=2, vocab=49155, bias=True, tie=False)


@pytest.fixture(scope="module")
def replicated_kv_model(tmp_path_factory, default_model_dir) -> Path:
    """4 query heads, 1 kv head (replicated on both ranks at TP=2), the LM head tied to the embedding."""
    path = tmp_path_factory.mktemp("tp-replicated")
    return save_llama(path, default_model_dir, heads=4, kv_heads=1, vocab=49152, bias=False, tie=True, seed=1)


def _generate(model_dir: Path, tp: int, max_tokens: int = MAX_TOKENS):
    """Greedy outputs of PROMPTS from one LLM (6 sequences a step at most: several in flight at once), and
    its step counts."""
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        tensor_parallel_size=tp,
        num_blocks=256,
        max_num_seqs=6,
        max_num_batched_tokens=64,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        return outputs, llm.core.stats
    finally:
        llm.close()


def _transformers_greedy(model_dir: Path, outputs, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    hf = load_hf(model_dir)
    return [hf_greedy(hf, list(o.prompt_token_ids), max_tokens) for o in outputs]


# ---- the shapes a group size must divide --------------------------------------------------------------


def test_default_model_splits_over_three_ranks_and_refuses_two_saying_which_sizes_fit(default_model_dir):
    config = read_model_config(default_model_dir)
    assert (config.num_heads, config.num_kv_heads) == (9, 3)
    check_tensor_parallel(config, 3)
    local = shard_config(config, 3)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (
        3,
        1,
        config.intermediate_size // 3,
    )
    with pytest.raises(
        ValueError, match=r"--tensor-parallel-size 2 does not divide its 9 query heads"
    ) as error:
        check_tensor_parallel(config, 2)
    assert str(error.value).endswith("sizes this model allows: 3")


def test_fewer_kv_heads_than_ranks_are_replicated_and_other_shapes_refused(default_model_dir):
    config = read_model_config(default_model_dir)
    from dataclasses import replace

    four = replace(config, num_heads=8, num_kv_heads=2, intermediate_size=64)
    assert shard_config(four, 4).num_kv_heads == 1  # 2 kv heads, 4 ranks: each held by two ranks
    check_tensor_parallel(four, 4)
    with pytest.raises(ValueError, match="nor is it a multiple of them"):
        check_tensor_parallel(replace(four, num_heads=12, num_kv_heads=3, intermediate_size=72), 2)
    with pytest.raises(ValueError, match="intermediate size 66"):
        check_tensor_parallel(replace(four, intermediate_size=66), 4)
    with pytest.raises(ValueError, match="at least 1"):
        check_tensor_parallel(four, 0)


def test_engine_refuses_a_group_size_the_model_cannot_split_before_starting_any_rank(default_model_dir):
    with pytest.raises(ValueError, match="does not divide its 9 query heads"):
        LLM(str(default_model_dir), device="cpu", tensor_parallel_size=2)


def test_cuda_ranks_use_nccl_a_gpu_each_and_are_refused_without_enough_gpus(default_model_dir):
    assert ParallelGroup(0, 2, torch.device("cuda", 0)).backend == "nccl"
    assert ParallelGroup(0, 2, torch.device("cpu")).backend == "gloo"
    assert rank_device(torch.device("cpu"), 1) == torch.device("cpu")
    gpus = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"rank 2 needs cuda:{gpus + 2}, but {gpus} GPU\(s\) are visible"):
        LLM(str(default_model_dir), device=f"cuda:{gpus}", tensor_parallel_size=3)


def test_serve_gives_each_workers_ranks_gpus_of_their_own_and_shares_out_the_cores(monkeypatch):
    from pagedserve import launcher

    def workers(gpus: int, *argv: str) -> list[tuple[str, ...]]:
        monkeypatch.setattr(launcher, "_cuda_device_count", lambda: gpus)
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
        config = launcher.LaunchConfig(**vars(launcher.build_parser().parse_args(argv)))
        out = []
        for args in launcher._child_args(config, "/m", "127.0.0.1:1", 1)[1]:
            flags = ("--device", "--tensor-parallel-size", "--gpu-memory-utilization", "--threads")
            out.append(tuple(args[args.index(f) + 1] if f in args else None for f in flags))
        return out

    # Worker 0's ranks on cuda:0-1, worker 1's on cuda:2-3, each GPU whole.
    tp2 = ("--tensor-parallel-size", "2")
    assert workers(4, "--workers", "2", *tp2, "--device", "cuda") == [
        ("cuda:0", "2", "0.9", "2"),
        ("cuda:2", "2", "0.9", "2"),
    ]
    assert workers(0, *tp2, "--device", "cpu") == [("cpu", "2", None, "4")]
    assert workers(0, "--device", "cpu") == [("cpu", None, None, None)]


# ---- output: TP=2 equals TP=1 equals transformers -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", ["split_kv_model", "replicated_kv_model"])
def test_tp2_greedy_output_equals_one_process_and_transformers_while_batched(model, request):
    model_dir = request.getfixturevalue(model)
    tp2, stats = _generate(model_dir, 2)
    tp1, _ = _generate(model_dir, 1)
    assert stats.num_batched_steps > 0  # several prompts computed together
    expected = _transformers_greedy(model_dir, tp2)
    for out2, out1, want in zip(tp2, tp1, expected, strict=True):
        assert list(out2.outputs[0].token_ids) == want
        assert list(out1.outputs[0].token_ids) == want
        assert out2.outputs[0].text == out1.outputs[0].text


@pytest.mark.slow
def test_default_model_at_tp3_greedy_output_equals_transformers_while_batched(default_model_dir):
    outputs, stats = _generate(default_model_dir, 3, max_tokens=16)
    assert stats.num_batched_steps > 0
    expected = _transformers_greedy(default_model_dir, outputs, max_tokens=16)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert outputs[0].outputs[0].text.strip().startswith("Paris")


@pytest.mark.slow
@pytest.mark.anyio
async def test_async_engine_with_two_ranks_streams_concurrent_requests_as_transformers_greedy(split_kv_model):
    engine = AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(
            model=str(split_kv_model), dtype="float32", device="cpu", tensor_parallel_size=2, max_num_seqs=8
        )
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

        async def final(i: int):
            async for output in engine.generate(PROMPTS[i], params, request_id=f"r{i}"):
                last = output
            return last

        outputs = await asyncio.wait_for(asyncio.gather(*(final(i) for i in range(6))), 120)
    finally:
        engine.shutdown()
    assert engine.core.stats.num_batched_steps > 0
    expected = _transformers_greedy(split_kv_model, outputs)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


# ---- a rank that dies fails its group; the group comes back --------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _rank_pid(worker_pid: int, rank: int) -> int | None:
    for pid in _children(worker_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"pagedserve.worker_svc.parallel" in cmdline
            and cmdline[cmdline.index(b"--rank") + 1] == str(rank).encode()
        ):
            return pid
    return None


@pytest.mark.slow
def test_an_engine_whose_rank_died_fails_its_next_step_clearly(replicated_kv_model):
    llm = LLM(str(replicated_kv_model), dtype="float32", device="cpu", tensor_parallel_size=2, num_blocks=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        (rank1,) = llm.core.worker.ranks.processes
        rank1.kill()
        rank1.wait(timeout=60)
        with pytest.raises(RankFailedError, match="tensor-parallel group of 2: a collective failed"):
            llm.generate(PROMPTS[1], params, use_tqdm=False)
    finally:
        llm.close()


@pytest.fixture
def tp_stack(tmp_path_factory, default_model_dir):
    """`pagedserve serve` with one worker of two ranks, over a Llama slow enough per step that streams of
    hundreds of tokens are still running when a rank dies."""
    model_dir = save_llama(
        tmp_path_factory.mktemp("tp-served"),
        default_model_dir,
        heads=4,
        kv_heads=2,
        vocab=49152,
        bias=False,
        tie=False,
        hidden=256,
        layers=4,
        max_position=2048,
    )
    args = ["--workers", "1", "--tensor-parallel-size", "2", "--dtype", "float32", "--device", "cpu"]
    args += ["--num-blocks", "512", "--max-restarts-per-minute", "3", "--log-level", "info"]
    stack = Stack(model_dir, tmp_path_factory.mktemp("tp-logs"), serve_args=args)
    with running(stack):
        yield stack


@pytest.mark.slow
def test_rank_killed_mid_stream_fails_its_group_which_restarts_and_the_streams_complete(tp_stack):
    stack = tp_stack
    stats = stack.engine_stats()
    (worker,) = stats.workers  # the group is one worker to the scheduler, with the pool's block count once
    assert worker.healthy and worker.num_blocks == 512
    bodies = [{"prompt": p, "temperature": 0.0, "max_tokens": 400, "ignore_eos": True} for p in PROMPTS[:6]]
    with httpx.Client(base_url=stack.http_url, timeout=600) as client:
        with ThreadPoolExecutor(len(bodies)) as pool:  # fault-free
            baseline = list(pool.map(lambda body: stream_completion(client, body), bodies))
        first_token = [threading.Event() for _ in bodies]
        finished = [threading.Event() for _ in bodies]

        worker_pid = stack.child_pid("worker-0")
        rank1 = _rank_pid(worker_pid, 1)
        assert rank1 is not None, "rank 1 is a child process of the worker"
        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = [
                pool.submit(stream_marking_progress, client, body, first_token[i], finished[i])
                for i, body in enumerate(bodies)
            ]
            for event in first_token:
                assert event.wait(180), "a stream received no token"
            in_flight = sum(not event.is_set() for event in finished)
            os.kill(rank1, signal.SIGKILL)
            results = [f.result(timeout=600) for f in futures]
        assert in_flight == len(bodies), "every stream was mid-stream when the rank died"
        for (text, finish), (ref_text, _, ref_finish) in zip(results, baseline, strict=True):
            assert text == ref_text  # recomputed on the restarted group: no token lost or repeated
            assert finish == ref_finish == "length"
        assert stream_completion(client, bodies[0]) == baseline[0]

    # Rank 0 left when rank 1 died; the launcher started the group again (a new rank 1 with it).
    exited = [e for e in stack.launcher_events("exited") if e["process"] == "worker-0"]
    assert [(e["pid"], e["code"]) for e in exited] == [(worker_pid, EXIT_RANK_DIED)]
    new_pid = stack.child_pid("worker-0")
    assert new_pid != worker_pid
    wait_for(lambda: _rank_pid(new_pid, 1), timeout=60, what="the restarted worker has no rank 1")
    assert "tensor_parallel_rank_died" in stack.stderr_path.read_text()
