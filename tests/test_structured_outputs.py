"""Structured outputs: the request surface, compiling constraints, the scheduler's masks and the pipeline,
the sampler applying them; then the whole stack driven by the openai SDK and the public gRPC API, where every
constrained output is checked against its constraint (jsonschema for the schemas, at temperature 1.0).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch
from stack_testing import MODEL, Stack, running

from pagedserve.errors import InvalidRequestError
from pagedserve.gateway.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.engine import Engine
from pagedserve.scheduler_svc.plan import PlanBuilder
from pagedserve.scheduler_svc.request import Request
from pagedserve.scheduler_svc.request_stream import RequestStream
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.scheduler_svc.service_config import SchedulerServiceConfig
from pagedserve.scheduler_svc.structured_output import GrammarCompiler, load_tokenizer
from pagedserve.structured_outputs import check_structured_output
from pagedserve.v1 import common_pb2, engine_pb2, text_generation_pb2, text_generation_pb2_grpc, worker_pb2
from pagedserve.worker_svc.sampler import Sampler, SamplingMetadata, SlotSamplingState

EOS = 2  # SmolLM2's <|im_end|>
VOCAB = 49152


def _body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def _constraint(**fields) -> tuple[common_pb2.StructuredOutput | None, str]:
    req = parse_request(ChatCompletionRequest, _body(**fields))
    sp = req.sampling_params()
    names = req.sampling_names()
    return (sp.structured_output if sp.HasField("structured_output") else None), names["structured_output"]


# ---- the request surface ----


def test_each_api_parameter_maps_to_one_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    so, param = _constraint(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    assert json.loads(so.json_schema) == schema and param == "response_format"
    so, param = _constraint(response_format={"type": "json_object"})
    assert so.json_object and param == "response_format"
    assert _constraint(response_format={"type": "text"})[0] is None
    so, param = _constraint(guided_json=json.dumps(schema))
    assert json.loads(so.json_schema) == schema and param == "guided_json"
    assert _constraint(guided_regex="[a-z]+")[0].regex == "[a-z]+"
    assert list(_constraint(guided_choice=["yes", "no"])[0].choice.choices) == ["yes", "no"]
    assert _constraint(guided_grammar='start: "a"')[0].grammar == 'start: "a"'
    so, param = _constraint(structured_outputs={"choice": ["a", "b"]})
    assert list(so.choice.choices) == ["a", "b"] and param == "structured_outputs"
    assert _constraint(structured_outputs={"json": schema})[0].json_schema
    req = parse_request(CompletionRequest, json.dumps({"prompt": "x", "guided_regex": "a+"}).encode())
    assert req.sampling_params().structured_output.regex == "a+"


def test_two_constraints_are_refused_naming_the_second():
    with pytest.raises(InvalidRequestError) as error:
        _constraint(response_format={"type": "json_object"}, guided_regex="a+")
    assert error.value.param == "guided_regex"
    with pytest.raises(InvalidRequestError) as error:
        _constraint(structured_outputs={"regex": "a", "choice": ["b"]})
    assert error.value.param == "structured_outputs"


@pytest.mark.parametrize(
    "so, message",
    [
        (
            common_pb2.StructuredOutput(json_schema='{"type": "integer", "minimum": 5, "maximum": 1}'),
            "minimum",
        ),
        (common_pb2.StructuredOutput(json_schema='{"type": "string", "format": "no-such-format"}'), "format"),
        (common_pb2.StructuredOutput(json_schema="[1, 2]"), "JSON object"),
        (common_pb2.StructuredOutput(json_schema="{not json"), "not valid JSON"),
        (common_pb2.StructuredOutput(regex="a(b"), "unclosed group"),
        (common_pb2.StructuredOutput(choice=common_pb2.ChoiceList()), "empty"),
        (common_pb2.StructuredOutput(grammar='start: x\nx: "a" | y'), "unknown name"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_naming_the_parameter(so, message):
    with pytest.raises(InvalidRequestError) as error:
        check_structured_output(so, "response_format")
    assert error.value.param == "response_format" and message in error.value.message


# ---- compiling, masks, the scheduler's pipeline ----


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir, VOCAB, [EOS])


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, timeout=30.0)
    yield compiler
    compiler.close()


def test_compiled_constraints_are_cached_by_their_spec(compiler):
    so = common_pb2.StructuredOutput(regex="(yes|no)")
    first = compiler.compile_sync(so)
    assert compiler.compile_sync(common_pb2.StructuredOutput(regex="(yes|no)")) is first
    assert compiler.compile_sync(common_pb2.StructuredOutput(regex="(yes|maybe)")) is not first


def test_a_compile_past_the_timeout_fails_alone_and_the_loop_goes_on(tokenizer):
    compiler = GrammarCompiler(tokenizer, timeout=0.2, max_workers=1)
    # The one compile thread is busy (as with a pathological grammar): the next compile cannot finish in time.
    busy = threading.Event()
    compiler._pool.submit(busy.wait, 30)

    async def go():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        with pytest.raises(InvalidRequestError) as error:
            await compiler.compile(common_pb2.StructuredOutput(regex="[a-z]+"), "guided_regex")
        ticker.cancel()
        return error.value, ticks

    error, ticks = asyncio.run(go())
    assert error.param == "guided_regex" and "longer than 0.2 s" in error.message
    assert compiler.num_timeouts == 1 and ticks >= 5  # the loop kept running meanwhile
    busy.set()
    # The abandoned compile finishes in the background; the same constraint later compiles from the cache.
    assert compiler.compile_sync(common_pb2.StructuredOutput(regex="[a-z]+")) is not None
    compiler.close()


def _step_result(out, tokens: dict[Request, int]) -> worker_pb2.StepResult:
    result = worker_pb2.StepResult(step_id=out.step_id)
    for req in out.sampled:
        result.sampled_slots.append(0)
        result.sampled_token_ids.append(tokens[req])
    return result


def _allowed(mask_words: np.ndarray) -> set[int]:
    return set(np.nonzero(np.unpackbits(mask_words.view(np.uint8), bitorder="little"))[0].tolist())


def test_a_constrained_request_is_not_pipelined_and_its_masks_follow_its_tokens(compiler, tokenizer):
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_model_len=512))
    plans = PlanBuilder()
    grammar = compiler.compile_sync(common_pb2.StructuredOutput(regex="4[0-9]"))
    constrained = Request("c", [5, 6, 7], 3, common_pb2.SamplingParams(max_tokens=8), frozenset({EOS}))
    constrained.grammar = grammar
    free = Request("f", [5, 6, 8], 3, common_pb2.SamplingParams(max_tokens=8), frozenset({EOS}))
    sched.add_request(constrained)
    sched.add_request(free)
    digits = [tokenizer.tokenize_str(str(d))[0] for d in range(10)]

    out1 = sched.schedule()
    plan1 = plans.build(out1).plan
    assert out1.masked == [constrained] and list(plan1.mask_slots) == [plans.slot_of(constrained)]
    assert _allowed(np.frombuffer(plan1.token_masks, dtype="<i4")) == {digits[4]}
    # Pipelined: the next plan leaves before result 1; the constrained request waits for its token.
    out2 = sched.schedule()
    assert out2.scheduled == [free] and not out2.masked and not plans.build(out2).plan.mask_slots
    assert sched.update_from_output(out1, _step_result(out1, {constrained: digits[4], free: 9}))
    out3 = sched.schedule()
    assert constrained in out3.scheduled and out3.masked == [constrained]
    assert _allowed(out3.token_masks[0]) == set(digits)
    sched.update_from_output(out2, _step_result(out2, {free: 9}))
    outputs = sched.update_from_output(out3, _step_result(out3, {constrained: digits[2], free: 9}))
    # "42" is complete and nothing may follow: it stops without sampling EOS.
    (done,) = [o for o in outputs if o.request_id == "c"]
    assert (
        done.finish_reason == common_pb2.FINISH_REASON_STOP
        and constrained.token_ids[3:] == digits[4:5] + digits[2:3]
    )


def test_a_token_the_grammar_refuses_fails_that_request_alone(compiler):
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_model_len=512))
    constrained = Request("c", [5, 6, 7], 3, common_pb2.SamplingParams(max_tokens=8), frozenset({EOS}))
    constrained.grammar = compiler.compile_sync(common_pb2.StructuredOutput(regex="4[0-9]"))
    free = Request("f", [5, 6, 8], 3, common_pb2.SamplingParams(max_tokens=8), frozenset({EOS}))
    sched.add_request(constrained)
    sched.add_request(free)
    out = sched.schedule()
    outputs = sched.update_from_output(out, _step_result(out, {constrained: 1000, free: 9}))
    (failure,) = sched.take_failures()
    assert failure.request_id == "c" and "refused token 1000" in failure.message
    assert [o.request_id for o in outputs] == ["f"] and sched.stats().num_running == 1


def test_forks_get_matchers_of_their_own(compiler, tokenizer):
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_model_len=512))
    req = Request("c", [5, 6, 7], 3, common_pb2.SamplingParams(max_tokens=8, n=2), frozenset({EOS}))
    req.grammar = compiler.compile_sync(
        common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=["1", "2"]))
    )
    sched.add_request(req)
    out1 = sched.schedule()
    sched.update_from_output(out1, _step_result(out1, {}))
    out2 = sched.schedule()
    assert len(out2.masked) == 2 and out2.masked[0].matcher is not out2.masked[1].matcher
    a, b = tokenizer.tokenize_str("1")[0], tokenizer.tokenize_str("2")[0]
    first, second = out2.masked
    outputs = sched.update_from_output(out2, _step_result(out2, {first: a, second: b}))
    assert [o.finish_reason for o in outputs] == [common_pb2.FINISH_REASON_STOP] * 2


def test_a_sequence_resumed_elsewhere_gets_a_matcher_fed_what_its_client_has_seen(compiler, tokenizer):
    msg = engine_pb2.GenerateTokensRequest(
        request_id="r",
        prompt_token_ids=[5, 6, 7],
        sampling=common_pb2.SamplingParams(
            max_tokens=8, structured_output=common_pb2.StructuredOutput(regex="4[0-9]")
        ),
    )
    stream = RequestStream(msg, grammar=compiler.compile_sync(msg.sampling.structured_output))
    digits = [tokenizer.tokenize_str(str(d))[0] for d in range(10)]
    stream.sequences[0].token_ids = [digits[4]]  # streamed before its worker failed
    (resumed,) = stream.core_requests(frozenset({EOS}))
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_model_len=512))
    sched.add_request(resumed)
    out = sched.schedule()
    assert out.masked == [resumed] and _allowed(out.token_masks[0]) == set(digits)


def test_without_a_tokenizer_json_a_constrained_request_is_refused():
    engine = Engine(SchedulerServiceConfig(), "fake", frozenset({EOS}), 512, VOCAB)
    msg = engine_pb2.GenerateTokensRequest(
        request_id="r",
        prompt_token_ids=[5],
        sampling=common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput(regex="a")),
    )
    with pytest.raises(InvalidRequestError, match=r"tokenizer\.json"):
        asyncio.run(engine.compile(msg))
    with pytest.raises(InvalidRequestError, match="not compiled"):
        engine.submit(msg)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_sampler_draws_only_tokens_the_mask_allows(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    vocab, rows = 70, 4  # not a multiple of 32: the last word's high bits are past the vocabulary
    allowed = [{3}, {5, 64, 69}, set(range(vocab)), {33}]
    words = np.zeros((3, (vocab + 31) // 32), dtype=np.int32)
    for i, tokens in enumerate([allowed[0], allowed[1], allowed[3]]):
        for t in tokens:
            words[i, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    sampler = Sampler(vocab, device, seed=0)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    for temperature in (0.0, 1.0):
        states = [SlotSamplingState(temperature=temperature) for _ in range(rows)]
        for _ in range(20):
            meta = SamplingMetadata.build(states, vocab, device)
            meta.token_mask = (torch.tensor([0, 1, 3], device=device), torch.from_numpy(words).to(device))
            tokens = sampler(logits.to(device), meta).token_ids.tolist()
            assert all(t in allowed[i] for i, t in enumerate(tokens)), tokens
            # Every row masked, in order (rows None), row 2 allowing everything.
            every = np.insert(words, 2, -1, axis=0)
            meta.token_mask = (None, torch.from_numpy(every).to(device))
            tokens = sampler(logits.to(device), meta).token_ids.tolist()
            assert all(t in allowed[i] for i, t in enumerate(tokens)), tokens
            if temperature == 0.0:  # each row's largest allowed logit (the unmasked row its own argmax)
                assert tokens == [
                    max(allowed[i], key=lambda t, i=i: float(logits[i, t])) for i in range(rows)
                ]
                # The same tokens from the general path (logprobs asked for), which masks a float32 copy.
                with_logprobs = [SlotSamplingState(temperature=0.0, logprobs=0) for _ in range(rows)]
                meta = SamplingMetadata.build(with_logprobs, vocab, device)
                meta.token_mask = (None, torch.from_numpy(every).to(device))
                assert not meta.masked_argmax_only
                assert sampler(logits.to(device), meta).token_ids.tolist() == tokens


# ---- the whole stack ----

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5}, "minItems": 2, "maxItems": 4}},
        "required": ["scores"],
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {"first": {"type": "string", "maxLength": 12}, "last": {"type": "string", "maxLength": 12}},
                "required": ["first", "last"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
    },
    {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}
        },
        "required": ["a"],
    },
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 10}]}}, "required": ["value"]},
    {"type": "object", "properties": {"nickname": {"type": ["string", "null"], "maxLength": 10}}, "required": ["nickname"]},
    {"type": "object", "properties": {"middle": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]}}, "required": ["middle"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}}, "required": ["price"]},
    {"type": "object", "properties": {"temp": {"type": "number", "exclusiveMinimum": -50, "exclusiveMaximum": 60}}, "required": ["temp"]},
    {"type": "object", "properties": {"count": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}}, "required": ["count"]},
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}, "label": {"type": "string", "maxLength": 6}},
                    "required": ["id", "label"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {
            "status": {"enum": ["active", "inactive"]},
            "level": {"type": "integer", "minimum": 1, "maximum": 3},
            "note": {"type": ["string", "null"], "maxLength": 12},
        },
        "required": ["status", "level", "note"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3, "maxItems": 3},
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {
        "type": "object",
        "properties": {"shape": {"anyOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["kind", "r"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["kind", "side"], "additionalProperties": False},
        ]}},
        "required": ["shape"],
    },
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}}, "required": ["from", "to"]},
]  # fmt: skip
for _schema in SCHEMAS:
    if _schema.get("type") == "object":
        _schema.setdefault("additionalProperties", False)  # bounded objects: the output must close


@pytest.fixture(scope="module")
def served(default_model_dir, tmp_path_factory):
    args = ["--dtype", "float32", "--num-blocks", "512", "--log-level", "warning", "--max-num-seqs", "32"]
    log_dir = tmp_path_factory.mktemp("structured-logs")
    with running(Stack(default_model_dir, log_dir, serve_args=args)) as stack:
        stack.client = openai.OpenAI(
            base_url=stack.openai_base_url, api_key="unused", max_retries=0, timeout=600
        )
        yield stack


def _ask(served: Stack, content: str, **kwargs):
    kwargs.setdefault("max_tokens", 160)
    return served.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kwargs
    )


@pytest.mark.slow
def test_every_output_is_valid_against_its_schema_at_temperature_one(served):
    def one(i_schema):
        i, schema = i_schema
        reply = _ask(
            served,
            f"Reply with JSON matching this schema: {json.dumps(schema)}",
            temperature=1.0,
            seed=i,
            max_tokens=200,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
            },
        )
        return schema, reply.choices[0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, enumerate(SCHEMAS)))
    assert len(results) >= 20
    for schema, choice in results:
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
    served.wait_idle()


@pytest.mark.slow
def test_json_object_regex_choice_and_grammar_through_the_openai_sdk(served):
    # NOTE: greedy: any object may have any keys, and a sampled one need not close within max_tokens.
    reply = _ask(
        served,
        "Describe a cat as JSON.",
        temperature=0,
        response_format={"type": "json_object"},
        max_tokens=300,
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    pattern = r"[0-9]{3}-[0-9]{4}"
    reply = _ask(served, "Give me a phone number.", temperature=1.0, extra_body={"guided_regex": pattern})
    assert (
        re.fullmatch(pattern, reply.choices[0].message.content) and reply.choices[0].finish_reason == "stop"
    )
    choices = ["positive", "negative", "neutral"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        reply = _ask(served, "The movie was great! Sentiment?", temperature=1.0, extra_body=extra)
        assert reply.choices[0].message.content in choices and reply.choices[0].finish_reason == "stop"
    grammar = 'start: "The answer is " ("yes" | "no") "."'
    completion = served.client.completions.create(
        model=MODEL,
        prompt="Is water wet?",
        max_tokens=20,
        temperature=1.0,
        extra_body={"guided_grammar": grammar},
    )
    assert completion.choices[0].text in ("The answer is yes.", "The answer is no.")
    served.wait_idle()


@pytest.mark.slow
def test_streamed_constrained_output_and_n_greater_than_one(served):
    choices = ["red", "green", "blue"]
    stream = _ask(
        served, "Pick a color.", temperature=1.0, n=3, stream=True, extra_body={"guided_choice": choices}
    )
    texts = ["", "", ""]
    reasons = [None] * 3
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert all(t in choices for t in texts) and reasons == ["stop"] * 3
    served.wait_idle()


@pytest.mark.slow
def test_constrained_and_free_requests_side_by_side_are_all_correct(served):
    schema = SCHEMAS[6]

    def constrained(i):
        reply = _ask(
            served,
            "A person as JSON.",
            temperature=1.0,
            seed=100 + i,
            max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        )
        return "json", reply.choices[0]

    def free(i):
        reply = _ask(served, "Tell me a story.", temperature=1.0, seed=200 + i, max_tokens=40)
        return "free", reply.choices[0]

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(constrained if i % 2 else free, i) for i in range(12)]
        results = [f.result() for f in futures]
    for kind, choice in results:
        if kind == "json":
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), schema)
        else:
            assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert served.wait_idle().num_blocks_in_use == 0


@pytest.mark.slow
def test_the_same_constraint_over_grpc(served):
    sampling = common_pb2.SamplingParams(
        max_tokens=40,
        temperature=1.0,
        structured_output=common_pb2.StructuredOutput(regex="(yes|no), because [a-z ]{1,20}\\."),
    )
    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = text_generation_pb2_grpc.TextGenerationServiceStub(channel)
        messages = list(
            stub.Generate(
                text_generation_pb2.GenerateRequest(prompt="Is the sky blue?", sampling=sampling), timeout=120
            )
        )
        text = "".join(m.text for m in messages)
        assert re.fullmatch("(yes|no), because [a-z ]{1,20}\\.", text), text
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        bad = common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput(regex="a(b"))
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(text_generation_pb2.GenerateRequest(prompt="x", sampling=bad), timeout=30))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_output" in error.value.details()


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{oops"}, "guided_json"),
        ({"guided_grammar": "start: x"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_bad_constraints_get_a_400_naming_the_parameter(served, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    response = httpx.post(f"{served.openai_base_url}/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.slow
def test_the_offline_llm_takes_vllms_structured_outputs_params():
    from pagedserve import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams

    llm = LLM(dtype="float32", num_blocks=128, max_num_seqs=8)
    pattern = r"[0-9]{3}-[0-9]{4}"
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=pattern)
        )
        for i in range(3)
    ]
    params.append(
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=120, guided_decoding=GuidedDecodingParams(json=SCHEMAS[17])
        )
    )
    params.append(SamplingParams(temperature=1.0, seed=4, max_tokens=8))  # unconstrained, alongside
    outs = llm.generate(["Phone:"] * 3 + ["JSON:", "Hello"], params, use_tqdm=False)
    for out in outs[:3]:
        assert re.fullmatch(pattern, out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
    assert outs[3].outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(outs[3].outputs[0].text), SCHEMAS[17])
    assert len(outs[4].outputs[0].token_ids) <= 8
    assert llm.scheduler.stats().num_blocks_in_use == 0
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b"))
    with pytest.raises(ValueError, match="one constraint"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=["a"]))


# ---- tool calling, through the openai SDK ----

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls, names) -> list[tuple[str, dict]]:
    assert calls
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, TOOL_SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def _streamed_calls(stream) -> tuple[str, list[tuple[str, dict]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


@pytest.mark.slow
@pytest.mark.parametrize(
    "tool_choice, names",
    [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ],
)
def test_required_and_named_tool_choice_always_give_valid_calls(served, tool_choice, names):
    # NOTE: one call (parallel_tool_calls false): with parallel calls a sampled model may go on calling.
    reply = _ask(
        served,
        WEATHER_QUESTION[0]["content"],
        temperature=1.0,
        seed=7,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(_check_calls(choice.message.tool_calls, names)) == 1


@pytest.mark.slow
def test_a_streamed_tool_call_gives_the_same_calls_as_a_whole_one(served):
    kwargs = dict(
        temperature=1.0,
        seed=11,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    whole = _ask(served, WEATHER_QUESTION[0]["content"], **kwargs).choices[0]
    content, calls, finish = _streamed_calls(
        _ask(served, WEATHER_QUESTION[0]["content"], stream=True, **kwargs)
    )
    assert finish == "tool_calls" and not content
    assert calls == [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


@pytest.mark.slow
def test_tool_results_in_the_history_and_tool_choice_none(served):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    reply = served.client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=24, temperature=0
    )
    choice = reply.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
    served.wait_idle()


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_tools_get_a_400_naming_the_parameter(served, fields, param):
    body = {"model": MODEL, "messages": WEATHER_QUESTION, "max_tokens": 4, **fields}
    response = httpx.post(f"{served.openai_base_url}/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def _grpc_tool(tool: dict) -> text_generation_pb2.Tool:
    function = tool["function"]
    return text_generation_pb2.Tool(
        name=function["name"],
        description=function["description"],
        parameters_json=json.dumps(function["parameters"]),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tool_choice", "names"), [("required", {"get_weather", "get_time"}), ("get_time", {"get_time"})]
)
def test_tool_calls_over_grpc(served, tool_choice, names):
    # The same tools and choices as over HTTP: the calls come parsed on each sequence's last message, valid
    # against their function's schema, and the history may carry an assistant's calls and a tool's answer.
    tools = [_grpc_tool(WEATHER_TOOL), _grpc_tool(TIME_TOOL)]
    request = text_generation_pb2.GenerateRequest(
        messages=[text_generation_pb2.ChatMessage(role="user", content=WEATHER_QUESTION[0]["content"])],
        sampling=common_pb2.SamplingParams(max_tokens=80, temperature=1.0, seed=7),
        tools=tools,
        tool_choice=tool_choice,
    )
    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = text_generation_pb2_grpc.TextGenerationServiceStub(channel)
        messages = list(stub.Generate(request, timeout=120))
        last = messages[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
        assert len(last.tool_calls) == 1 and last.tool_calls[0].id.startswith("call_")
        (call,) = last.tool_calls
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments_json), TOOL_SCHEMAS[call.name])
        follow_up = text_generation_pb2.GenerateRequest(
            messages=[
                *request.messages,
                text_generation_pb2.ChatMessage(role="assistant", tool_calls=[call]),
                text_generation_pb2.ChatMessage(role="tool", tool_call_id=call.id, content='{"answer": 1}'),
            ],
            sampling=common_pb2.SamplingParams(max_tokens=16, temperature=0.0),
            tools=tools,
            tool_choice="none",
        )
        answer = list(stub.Generate(follow_up, timeout=120))
        assert answer[-1].finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        assert not answer[-1].tool_calls
        for bad, param in [
            (text_generation_pb2.Tool(name="f", parameters_json="[1]"), "tools"),
            (text_generation_pb2.Tool(name=""), "tools"),
        ]:
            broken = text_generation_pb2.GenerateRequest(
                messages=request.messages, tools=[bad], tool_choice="required"
            )
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(broken, timeout=30))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and param in error.value.details()
    assert served.wait_idle().num_blocks_in_use == 0
