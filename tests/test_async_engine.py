"""The asyncio API: `AsyncLLMEngine.generate` streams over the engine core that `LLM` runs too."""

from __future__ import annotations

import asyncio
import gc
import itertools

import pytest

from pagedserve import AsyncEngineArgs, AsyncLLMEngine, RequestOutputKind, SamplingParams
from pagedserve.async_engine import AsyncLLM, EngineDeadError

pytestmark = pytest.mark.anyio

# Used by the comparison with LLM alone: a prompt the engine has seen may hit the prefix cache, and a
# prefix hit may change a greedy token in reduced precision.
PROMPTS = [
    "The capital of Italy is",
    "def quicksort(arr):",
    "In a small village",
    "The three primary colors are",
]
# Seconds a test waits for an event before it fails; generous, as the machine may be busy.
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def engine(default_model_dir):
    # vLLM's own usage, with only the import changed.
    engine = AsyncLLMEngine.from_engine_args(
        AsyncEngineArgs(
            model=str(default_model_dir),
            tensor_parallel_size=1,
            max_num_seqs=128,
            max_num_batched_tokens=2048,
            disable_log_requests=True,
        )
    )
    yield engine
    engine.shutdown()


async def collect(engine, prompt, sp, request_id) -> list:
    async def run():
        return [output async for output in engine.generate(prompt, sp, request_id=request_id)]

    return await asyncio.wait_for(run(), DEADLINE_S)


async def wait_until(condition, what: str) -> None:
    """Poll condition (no timing asserted: only a deadline to fail on)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not condition():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        gc.collect()  # finalizes async generators a consumer left
        await asyncio.sleep(0.02)


def no_block_in_use(engine) -> bool:
    core = engine.core
    return not core.requests and core.scheduler.stats().num_blocks_in_use == 0


def test_async_llm_is_the_same_engine():
    assert AsyncLLM is AsyncLLMEngine


def test_tensor_parallel_size_below_one_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        AsyncEngineArgs(tensor_parallel_size=0)


def test_unknown_engine_args_are_a_type_error():
    with pytest.raises(TypeError):
        AsyncEngineArgs(no_such_option=1)


def test_invalid_sampling_params_raise_value_error():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(output_kind="delta")


@pytest.mark.slow
async def test_the_vllm_usage_streams_to_a_finished_output(engine):
    sp = SamplingParams(temperature=0, max_tokens=8)
    last = None
    async for output in engine.generate("The capital of France is", sp, request_id="vllm-shape"):
        last = output
        if output.finished:
            break
    assert last is not None and last.finished
    assert last.outputs[0].text and last.outputs[0].finish_reason in ("stop", "length")
    assert engine.is_running and not engine.errored
    await engine.check_health()


@pytest.mark.slow
async def test_greedy_outputs_equal_llm_generate(engine):
    from pagedserve import LLM

    core = engine.core
    llm = LLM(
        str(core.model_dir), dtype=str(core.dtype).removeprefix("torch."), device=str(core.kv_cache.device)
    )
    sp = SamplingParams(temperature=0, max_tokens=12)
    want = llm.generate(PROMPTS, sp, use_tqdm=False)
    got = await asyncio.gather(*(collect(engine, p, sp, f"greedy-{i}") for i, p in enumerate(PROMPTS)))
    for expected, outputs in zip(want, got, strict=True):
        final = outputs[-1]
        assert final.finished
        assert final.outputs[0].token_ids == expected.outputs[0].token_ids
        assert final.outputs[0].text == expected.outputs[0].text
        assert final.outputs[0].finish_reason == expected.outputs[0].finish_reason


@pytest.mark.slow
async def test_concurrent_requests_are_batched_into_shared_steps(engine):
    before = engine.core.stats.num_batched_steps
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = await asyncio.gather(*(collect(engine, f"Count to {i}:", sp, f"batch-{i}") for i in range(8)))
    assert all(len(r[-1].outputs[0].token_ids) == 8 for r in results)
    assert engine.core.stats.num_batched_steps > before


@pytest.mark.slow
async def test_prompts_as_token_ids_and_dicts(engine):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = engine.core.encode("The capital of France is")[1]
    by_text = await collect(engine, {"prompt": "The capital of France is"}, sp, "dict-text")
    by_ids = await collect(engine, ids, sp, "ids")
    by_dict = await collect(engine, {"prompt_token_ids": ids}, sp, "dict-ids")
    assert by_text[-1].prompt == "The capital of France is" and by_ids[-1].prompt is None
    assert (
        by_text[-1].outputs[0].token_ids
        == by_ids[-1].outputs[0].token_ids
        == by_dict[-1].outputs[0].token_ids
    )


@pytest.mark.slow
async def test_delta_outputs_concatenate_to_the_cumulative_text(engine):
    # Run together, so that neither finds the other's blocks in the prefix cache.
    prompt = "Write a sentence about the sea:"
    cumulative, deltas, final_only = await asyncio.gather(
        *(
            collect(engine, prompt, SamplingParams(temperature=0, max_tokens=24, output_kind=kind), kind.name)
            for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)
        )
    )
    whole = cumulative[-1].outputs[0]
    assert len(deltas) > 1
    assert "".join(o.outputs[0].text for o in deltas) == whole.text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == whole.token_ids
    # Cumulative outputs grow; the one final-only output is the whole result.
    assert all(b.outputs[0].text.startswith(a.outputs[0].text) for a, b in itertools.pairwise(cumulative))
    assert len(final_only) == 1 and final_only[0].finished
    assert final_only[0].outputs[0].text == whole.text


@pytest.mark.slow
async def test_abort_mid_stream_ends_the_stream_and_frees_every_block(engine):
    sp = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    seen = []

    async def consume():
        async for output in engine.generate("Tell me a long story.", sp, request_id="to-abort"):
            seen.append(output)
            if len(seen) == 2:
                await engine.abort("to-abort")

    await asyncio.wait_for(consume(), DEADLINE_S)
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert len(seen[-1].outputs[0].token_ids) < 500
    await wait_until(lambda: no_block_in_use(engine), "the aborted request's blocks to be freed")


@pytest.mark.slow
async def test_a_consumer_that_breaks_early_aborts_its_request(engine):
    sp = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    async for output in engine.generate("Tell me a long story.", sp, request_id="left"):
        if len(output.outputs[0].token_ids) >= 2:
            break
    await wait_until(lambda: no_block_in_use(engine), "the abandoned request's blocks to be freed")
    # The id is free again once its consumer has gone.
    outputs = await collect(engine, "Hi", SamplingParams(temperature=0, max_tokens=2), "left")
    assert outputs[-1].finished


@pytest.mark.slow
async def test_a_cancelled_consumer_aborts_its_request(engine):
    sp = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate("Tell me a long story.", sp, request_id="cancelled"):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), DEADLINE_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: no_block_in_use(engine), "the cancelled request's blocks to be freed")


@pytest.mark.slow
async def test_a_duplicate_live_request_id_is_refused(engine):
    sp = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    first = engine.generate("Tell me a long story.", sp, request_id="twice")
    await asyncio.wait_for(anext(first), DEADLINE_S)
    with pytest.raises(ValueError, match="already running"):
        await anext(engine.generate("Hello", sp, request_id="twice"))
    await first.aclose()
    await wait_until(lambda: no_block_in_use(engine), "the first request's blocks to be freed")


@pytest.mark.slow
async def test_a_refused_request_fails_alone(engine):
    too_long = list(range(1, engine.core.max_model_len + 2))
    with pytest.raises(ValueError):
        await collect(engine, too_long, SamplingParams(max_tokens=4), "too-long")
    outputs = await collect(engine, "Hi", SamplingParams(temperature=0, max_tokens=2), "after-refusal")
    assert outputs[-1].finished and engine.is_running


@pytest.mark.slow
async def test_get_tokenizer_and_model_config(engine):
    tokenizer = await engine.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("Paris")).strip().endswith("Paris")
    config = await engine.get_model_config()
    assert config.max_model_len == engine.core.max_model_len


@pytest.mark.slow
async def test_an_error_in_the_step_loop_fails_every_live_iterator(default_model_dir):
    failing = AsyncLLMEngine(AsyncEngineArgs(model=str(default_model_dir), num_gpu_blocks_override=64))
    try:
        runner = failing.core.runner
        execute = runner.execute
        broke = asyncio.Event()
        loop = asyncio.get_running_loop()

        def execute_then_break(plan, *args, **kwargs):
            if any(r.request_id == "break" for r in plan.new_requests):
                loop.call_soon_threadsafe(broke.set)
                raise RuntimeError("the device fell over")
            return execute(plan, *args, **kwargs)

        runner.execute = execute_then_break
        sp = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        running = failing.generate("Tell me a long story.", sp, request_id="running")
        await asyncio.wait_for(anext(running), DEADLINE_S)
        breaking = asyncio.create_task(collect(failing, "Hello", sp, "break"))
        await asyncio.wait_for(broke.wait(), DEADLINE_S)
        with pytest.raises(EngineDeadError, match="the device fell over"):
            while True:
                await asyncio.wait_for(anext(running), DEADLINE_S)
        with pytest.raises(EngineDeadError):
            await breaking
        assert failing.errored and not failing.is_running
        with pytest.raises(EngineDeadError):
            await failing.check_health()
        with pytest.raises(EngineDeadError):
            await collect(failing, "Hi", sp, "after")
    finally:
        failing.shutdown()
