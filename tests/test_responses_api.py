"""The Responses API (`/v1/responses`) and the reasoning parser, driven by the real openai SDK against the whole
stack (`pagedserve serve --reasoning-parser qwen3`) on loopback. Greedy Responses are compared with the chat
completion they mean (same model, same template), whose answers other tests check against transformers; tool
calls and reasoning are driven by grammars so that the model's real output has the shape under test. The store
and the request's conversion are also checked in-process.
"""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import openai
import pydantic
import pytest
from stack_testing import MODEL, Stack, running
from test_structured_outputs import TIME_TOOL, WEATHER_TOOL

from pagedserve.errors import InvalidRequestError, NotFoundError
from pagedserve.gateway.responses_api import ResponsesRequest, ResponseStore, input_messages
from pagedserve.v1 import common_pb2, text_generation_pb2, text_generation_pb2_grpc

QUESTION = "What is the capital of France?"
# SmolLM2's own system prompt (its template's default): the instructions under which it answers best.
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
MAX_STORED = 6
# The chat tests' tools in the Responses API's flat shape.
WEATHER = {"type": "function", **WEATHER_TOOL["function"]}
TIME = {"type": "function", **TIME_TOOL["function"]}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
# A thinking model's output, the thought and the answer sampled: the grammar only fixes the tags.
THINKING = 'start: "<think>" /[a-z ]{1,40}/ "</think>" /[A-Z][a-z ]{1,20}/'
THINKING_CALL = (
    'start: "<think>" /[a-z ]{1,40}/ "</think>\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", '
    '\\"arguments\\": {\\"city\\": \\"" /[A-Z][a-z]{1,10}/ "\\", \\"unit\\": \\"celsius\\"}}\\n</tool_call>"'
)


@pytest.fixture(scope="module")
def served(default_model_dir, tmp_path_factory):
    args = ["--dtype", "float32", "--num-blocks", "256", "--log-level", "warning", "--max-num-seqs", "8"]
    args += ["--reasoning-parser", "qwen3", "--max-stored-responses", str(MAX_STORED)]
    log_dir = tmp_path_factory.mktemp("responses-logs")
    with running(Stack(default_model_dir, log_dir, serve_args=args)) as stack:
        stack.client = openai.OpenAI(
            base_url=stack.openai_base_url, api_key="unused", max_retries=0, timeout=600
        )
        yield stack


def _chat_text(served: Stack, messages: list[dict], **kwargs) -> tuple[str, openai.types.CompletionUsage]:
    reply = served.client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)
    return reply.choices[0].message.content, reply.usage


def _events(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


# ---- stateless ----


@pytest.mark.slow
def test_a_response_says_what_the_chat_completion_it_means_says(served):
    response = served.client.responses.create(
        model=MODEL, input=QUESTION, instructions=SYSTEM, temperature=0, max_output_tokens=40
    )
    expected, usage = _chat_text(
        served,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_completion_tokens=40,
    )
    assert "Paris" in expected
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed" and response.error is None and response.incomplete_details is None
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert [p.type for p in message.content] == ["output_text"]
    assert response.output_text == expected
    assert response.usage.input_tokens == usage.prompt_tokens
    assert response.usage.output_tokens == usage.completion_tokens
    assert response.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert response.instructions == SYSTEM and response.max_output_tokens == 40


@pytest.mark.slow
def test_input_items_and_content_parts_are_the_conversation(served):
    items = [
        {"role": "developer", "content": "You are a geography teacher."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a city in France."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Lyon."}]},
        {"role": "user", "content": "And its capital?"},
    ]
    response = served.client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=24)
    chat = [
        {"role": "developer", "content": "You are a geography teacher."},
        {"role": "user", "content": "Name a city in France."},
        {"role": "assistant", "content": "Lyon."},
        {"role": "user", "content": "And its capital?"},
    ]
    assert response.output_text == _chat_text(served, chat, max_completion_tokens=24)[0]


@pytest.mark.slow
def test_max_output_tokens_makes_an_incomplete_response_streamed_or_not(served):
    response = served.client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"
    events = _events(
        served.client.responses.create(
            model=MODEL, input=QUESTION, temperature=0, max_output_tokens=3, stream=True
        )
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == response.output_text
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.slow
def test_a_streamed_response_sends_openais_events_in_order(served):
    kwargs = dict(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=40)
    whole = served.client.responses.create(**kwargs)
    events = _events(served.client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2] if hasattr(e, "item_id"))
    assert text == events[-4].text == events[-3].part.text == whole.output_text
    final = events[-1].response
    assert final.status == "completed" and final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The SDK's own accumulation of the events (it checks their identities and order) gives the same.
    with served.client.responses.stream(**kwargs) as stream:
        assert stream.get_final_response().output_text == whole.output_text


@pytest.mark.slow
@pytest.mark.parametrize(
    "tool_choice, names",
    [("required", {"get_weather", "get_time"}), ({"type": "function", "name": "get_time"}, {"get_time"})],
)
def test_function_tools_give_function_call_items_streamed_or_not(served, tool_choice, names):
    kwargs = dict(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=1.0,
        extra_body={"seed": 5},
    )
    response = served.client.responses.create(**kwargs)
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call" and call.status == "completed" and call.name in names
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    events = _events(served.client.responses.create(stream=True, **kwargs))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    done = events[-2].item
    assert (done.name, json.loads(done.arguments)) == (call.name, json.loads(call.arguments))
    assert events[3].delta == events[4].arguments == done.arguments
    with served.client.responses.stream(**kwargs) as stream:
        (streamed,) = stream.get_final_response().output
        assert (streamed.name, json.loads(streamed.arguments)) == (call.name, json.loads(call.arguments))


@pytest.mark.slow
def test_a_function_call_output_round_trip(served):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = served.client.responses.create(
        model=MODEL,
        input=question,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    (call,) = first.output
    answer = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": '{"temperature": 21, "sky": "clear"}',
    }
    second = served.client.responses.create(
        model=MODEL,
        input=[*question, *first.output, answer],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_output_tokens=24,
    )
    assert second.output[0].type == "message" and second.output_text
    # The same conversation as chat messages: an assistant's call, then the tool's answer.
    chat = [
        *question,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": answer["output"]},
    ]
    expected, _ = _chat_text(
        served, chat, tools=[WEATHER_TOOL],
        tool_choice="none", max_completion_tokens=24,
    )  # fmt: skip
    assert second.output_text == expected
    # The same through the store: the first response's call is in its conversation, the answer follows it.
    chained = served.client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[answer],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_output_tokens=24,
    )
    assert chained.output_text == expected


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=50)


@pytest.mark.slow
def test_text_format_constrains_the_output_and_the_sdk_parses_it(served):
    parsed = served.client.responses.parse(
        model=MODEL, input="Describe Paris as JSON.", text_format=City, temperature=1.0, max_output_tokens=120
    )
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, City)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}  # fmt: skip
    response = served.client.responses.create(
        model=MODEL,
        input="A digit as JSON.",
        text={"format": {"type": "json_schema", "name": "digit", "schema": schema, "strict": True}},
        temperature=1.0,
    )
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"
    response = served.client.responses.create(
        model=MODEL,
        input="Describe a cat as JSON.",
        text={"format": {"type": "json_object"}},
        temperature=0,
        max_output_tokens=300,
    )
    assert response.status == "completed" and isinstance(json.loads(response.output_text), dict)


# ---- stored responses ----


@pytest.mark.slow
def test_previous_response_id_continues_the_stored_conversation(served):
    first = served.client.responses.create(
        model=MODEL,
        input="My name is Ada. Say hello to me.",
        temperature=0,
        max_output_tokens=16,
        metadata={"k": "v"},
    )
    second = served.client.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=16,
    )
    assert second.previous_response_id == first.id
    conversation = [
        {"role": "user", "content": "My name is Ada. Say hello to me."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.output_text == _chat_text(served, conversation, max_completion_tokens=16)[0]
    # The chain goes on through the second, which holds the first's conversation.
    third = served.client.responses.create(
        model=MODEL,
        input="Say it again.",
        previous_response_id=second.id,
        temperature=0,
        max_output_tokens=16,
    )
    conversation += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Say it again."},
    ]
    assert third.output_text == _chat_text(served, conversation, max_completion_tokens=16)[0]
    got = served.client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.metadata == {"k": "v"}
    assert served.client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        served.client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as error:
        served.client.responses.create(model=MODEL, input="Hi", previous_response_id=first.id)
    assert error.value.body["param"] == "previous_response_id"
    unstored = served.client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        served.client.responses.retrieve(unstored.id)


@pytest.mark.slow
def test_a_streamed_response_is_stored_and_the_store_is_bounded(served):
    with served.client.responses.stream(
        model=MODEL, input=QUESTION, temperature=0, max_output_tokens=8
    ) as stream:
        streamed = stream.get_final_response()
    assert served.client.responses.retrieve(streamed.id).output_text == streamed.output_text
    later = [
        served.client.responses.create(model=MODEL, input=f"Count to {k}.", max_output_tokens=1).id
        for k in range(MAX_STORED)
    ]
    with pytest.raises(openai.NotFoundError):  # the least recently used went out
        served.client.responses.retrieve(streamed.id)
    assert all(served.client.responses.retrieve(i).id == i for i in later)
    served.wait_idle()


@pytest.mark.slow
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "function", "description": "no name"}]}, "tools"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text"),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text"),
        ({"text": {"format": {"type": "yaml"}}}, "text"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": ["hi"] * 3000}, "input"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_parameter(served, fields, param):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 4, **fields}
    response = httpx.post(f"{served.openai_base_url}/responses", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


@pytest.mark.slow
def test_unknown_response_ids_are_404_in_openais_shape(served):
    for method in ("GET", "DELETE"):
        response = httpx.request(method, f"{served.openai_base_url}/responses/resp_nope", timeout=30)
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "invalid_request_error"
    body = {"model": MODEL, "input": "Hi", "previous_response_id": "resp_nope"}
    response = httpx.post(f"{served.openai_base_url}/responses", json=body, timeout=30)
    assert response.status_code == 404 and response.json()["error"]["param"] == "previous_response_id"


# ---- reasoning (--reasoning-parser qwen3) ----


@pytest.mark.slow
def test_reasoning_goes_to_reasoning_content_streamed_or_not(served):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Think, then greet me."}],
        temperature=1.0,
        seed=3,
        max_tokens=80,
        extra_body={"guided_grammar": THINKING},
    )
    message = served.client.chat.completions.create(**kwargs).choices[0].message
    thought, answer = message.reasoning_content, message.content
    assert thought and answer and "<think>" not in answer and "think>" not in thought
    assert answer[0].isupper()
    stream = served.client.chat.completions.create(stream=True, **kwargs)
    streamed_thought, streamed_answer = "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        streamed_thought += getattr(delta, "reasoning_content", None) or ""
        streamed_answer += delta.content or ""
    assert (streamed_thought, streamed_answer) == (thought, answer)
    # An answer without thinking is all content (qwen3: no <think> at the start).
    plain = (
        served.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=12
        )
        .choices[0]
        .message
    )
    assert plain.content and plain.reasoning_content is None


@pytest.mark.slow
def test_reasoning_runs_before_the_tool_parser(served):
    tools = [WEATHER_TOOL]
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        temperature=1.0,
        seed=9,
        max_tokens=120,
        extra_body={"guided_grammar": THINKING_CALL},
    )
    choice = served.client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content and "<" not in choice.message.reasoning_content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    thought, content, calls, finish = "", "", [], None
    for chunk in served.client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        thought += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        calls += [(c.function.name, json.loads(c.function.arguments)) for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    assert (thought, content, finish) == (choice.message.reasoning_content, "", "tool_calls")
    assert calls == [(call.function.name, json.loads(call.function.arguments))]


@pytest.mark.slow
def test_reasoning_is_a_reasoning_item_in_the_responses_api(served):
    kwargs = dict(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        temperature=1.0,
        max_output_tokens=120,
        extra_body={"seed": 9, "guided_grammar": THINKING_CALL},
    )
    response = served.client.responses.create(**kwargs)
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and [c.type for c in reasoning.content] == ["reasoning_text"]
    assert reasoning.content[0].text and "<" not in reasoning.content[0].text
    assert call.type == "function_call" and call.name == "get_weather"
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    events = _events(served.client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.reasoning_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * deltas,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    assert final.output[0].content[0].text == reasoning.content[0].text
    assert (final.output[1].name, final.output[1].arguments) == (call.name, call.arguments)
    # Reasoning then a message: the reasoning item closes before the message opens.
    answer = served.client.responses.create(
        model=MODEL,
        input="Greet me.",
        temperature=1.0,
        max_output_tokens=80,
        extra_body={"seed": 3, "guided_grammar": THINKING},
    )
    assert [item.type for item in answer.output] == ["reasoning", "message"]
    assert answer.output_text and "think>" not in answer.output_text
    assert served.wait_idle().num_blocks_in_use == 0


@pytest.mark.slow
def test_reasoning_over_grpc_comes_split_on_the_last_message(served):
    tool = text_generation_pb2.Tool(name="get_weather", parameters_json=json.dumps(SCHEMAS["get_weather"]))
    sampling = common_pb2.SamplingParams(max_tokens=120, temperature=1.0, seed=9)
    sampling.structured_output.grammar = THINKING_CALL
    request = text_generation_pb2.GenerateRequest(
        messages=[text_generation_pb2.ChatMessage(role="user", content="What is the weather in Paris?")],
        sampling=sampling,
        tools=[tool],
    )
    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = text_generation_pb2_grpc.TextGenerationServiceStub(channel)
        messages = list(stub.Generate(request, timeout=120))
    text, last = "".join(m.text for m in messages), messages[-1]
    assert text.startswith("<think>")  # the stream is the model's raw text
    assert last.reasoning and last.reasoning == text[len("<think>") : text.index("</think>")].strip()
    assert last.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    (call,) = last.tool_calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments_json), SCHEMAS["get_weather"])


# ---- in-process: the request's conversion and the store ----


def test_function_call_items_join_the_assistant_message_before_them():
    messages = input_messages(
        [
            {"role": "user", "content": "Weather?"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "noon"}],
            },
        ]
    )
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["content"] == "Checking." and messages[3]["content"] == "noon"
    chat, conversation = ResponsesRequest(input="Hi", instructions="Be brief.", max_output_tokens=5).to_chat(
        messages
    )
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert conversation == [*messages, {"role": "user", "content": "Hi"}]  # the instructions are not kept
    assert chat.max_completion_tokens == 5


def test_a_function_call_with_bad_arguments_is_refused():
    with pytest.raises(InvalidRequestError) as error:
        input_messages([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}])
    assert error.value.param == "input"


def _response(response_id: str, text: str = "") -> dict:
    return {"id": response_id, "output": [{"text": text}]}


def test_the_store_is_bounded_in_count_and_bytes_and_keeps_tenants_apart():
    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for k in range(4):
        store.put(_response(f"r{k}"), [], tenant="a")
    assert len(store) == 3
    with pytest.raises(NotFoundError):
        store.get("r0", "a")
    store.get("r1", "a")  # now the most recently used
    store.put(_response("r4"), [], tenant="a")
    assert store.get("r1", "a") and len(store) == 3
    with pytest.raises(NotFoundError):
        store.get("r2", "a")
    with pytest.raises(NotFoundError):
        store.get("r1", "b")  # another tenant's
    assert not store.delete("r1", "b") and store.delete("r1", "a")
    big = ResponseStore(max_responses=100, max_bytes=10_000)
    for k in range(10):
        big.put(_response(f"r{k}", "x" * 3000), [], tenant="")
    assert big.num_bytes <= 10_000 and len(big) == 3
    big.put(_response("huge", "x" * 20_000), [], tenant="")  # larger than the whole store: not kept
    assert len(big) == 3
    assert ResponseStore(max_responses=0).put(_response("r"), [], "") is None
