"""``POST /v1/responses`` (OpenAI Responses API, stateless) driven by the ``openai`` SDK.

A real ``mlx-mtp serve`` process on a tiny checkpoint (greedy text equals
``/v1/chat/completions`` for the same conversation, the stream's events, function-call
input items, errors) and the real app over a scripted engine whose output holds
reasoning and a function call (output items, argument events, the round trip).
"""

import json

import httpx
import openai
import pytest

from mlx_mtp.server.events import Failed
from test_anthropic_api import (SAMPLED, SYSTEM, THOUGHT_AND_CALL, TOKENIZER,  # noqa: F401
                                scripted, server)  # fixtures

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                 if k != "type"}}


@pytest.fixture(scope="module")
def gpt(server):  # noqa: F811
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def chat_ref(gpt, server, messages, **kw):  # noqa: F811
    r = gpt.chat.completions.create(model=server.model, messages=messages, temperature=0, **kw)
    return r.choices[0].message.content, r


def test_greedy_text_equals_chat_completions(server, gpt):  # noqa: F811
    expected, ref = chat_ref(gpt, server, [{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": "Tell me about the sea"}],
                             max_tokens=20)
    r = gpt.responses.create(model=server.model, instructions=SYSTEM, temperature=0,
                             input="Tell me about the sea", max_output_tokens=20)
    assert r.object == "response" and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["message"]
    msg = r.output[0]
    assert msg.role == "assistant" and [c.type for c in msg.content] == ["output_text"]
    assert r.output_text == expected
    truncated = ref.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if truncated else "completed")
    if truncated:
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    assert r.usage.output_tokens == ref.usage.completion_tokens
    assert r.usage.total_tokens == ref.usage.total_tokens
    assert r.usage.input_tokens_details.cached_tokens > 0  # the same prompt ran just before
    # the same conversation as message items with text parts
    items = gpt.responses.create(model=server.model, temperature=0, max_output_tokens=20, input=[
        {"type": "message", "role": "developer", "content": SYSTEM},
        {"role": "user", "content": [{"type": "input_text", "text": "Tell me about the sea"}]}])
    assert items.output_text == expected


def test_stream_events(server, gpt):  # noqa: F811
    kw = dict(model=server.model, instructions=SYSTEM, temperature=0, max_output_tokens=16,
              input="Write a line of verse")
    whole = gpt.responses.create(**kw)
    events = list(gpt.responses.create(stream=True, **kw))
    names = [e.type for e in events]
    n = len(names)
    head = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.incomplete" if whole.status == "incomplete"
            else "response.completed"]
    assert names[:4] == head and names[n - 4:] == tail
    assert names[4:n - 4] == ["response.output_text.delta"] * (n - 8)
    assert [e.sequence_number for e in events] == list(range(1, n + 1))
    ids = {e.response.id for e in events if hasattr(e, "response")}
    assert len(ids) == 1
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[n - 4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_function_call_items_render_like_chat(server, gpt):  # noqa: F811
    expected, ref = chat_ref(gpt, server, tools=[CHAT_WEATHER], max_tokens=12, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    r = gpt.responses.create(model=server.model, tools=[WEATHER], temperature=0,
                             max_output_tokens=12, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}])
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    assert r.output_text == expected


def test_forced_tool_choice_yields_function_call(server, gpt):  # noqa: F811
    for choice in ({"type": "function", "name": "get_weather"}, "required"):
        r = gpt.responses.create(model=server.model, tools=[WEATHER], tool_choice=choice,
                                 temperature=0, max_output_tokens=8, input="Weather in Paris?")
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather", r.output
        assert isinstance(json.loads(calls[0].arguments), dict)


@pytest.mark.parametrize("body, status, words", [
    ({"input": "hi", "previous_response_id": "resp_123"}, 400, "stateless"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "takes no images"),  # a model without a vision tower (tests/test_vision_server.py: with)
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "stateless"),
    ({"input": "hi", "max_output_tokens": 100000}, 400, "context length"),
    ({"input": "hi", "model": "gpt-nope"}, 404, "gpt-nope"),
    ({"input": 5}, 400, "input"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
     "text.format.schema"),
])
def test_errors(server, body, status, words):  # noqa: F811
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"]
    if "text" in body:  # the missing schema is named as OpenAI names it
        assert err["param"] == "text.format.schema", err


def test_sdk_raises_on_previous_response_id(server, gpt):  # noqa: F811
    with pytest.raises(openai.BadRequestError, match="stateless"):
        gpt.responses.create(model=server.model, input="hi", previous_response_id="resp_1")


def test_penalties_bias_and_seed_equal_chat_completions(server, gpt):  # noqa: F811
    """Chat fields the Responses API lacks (penalties, logit_bias, seed, top_k, min_p, our
    mtp_coupled) are accepted as on the chat endpoint, with the same meaning."""
    messages = [{"role": "user", "content": "Write a story"}]
    ref = gpt.chat.completions.create(model=server.model, messages=messages, max_tokens=16,
                                      extra_body=dict(SAMPLED, top_k=50))
    r = gpt.responses.create(model=server.model, input="Write a story", max_output_tokens=16,
                             temperature=SAMPLED["temperature"],
                             extra_body={k: v for k, v in dict(SAMPLED, top_k=50).items()
                                         if k != "temperature"})
    assert r.output_text == ref.choices[0].message.content
    forced = gpt.responses.create(model=server.model, input="Write a story",
                                  max_output_tokens=6, temperature=1.0,
                                  extra_body={"logit_bias": {"87": 100}, "seed": 1})
    assert forced.output_text == TOKENIZER.decode([87] * 6)


def test_n_and_bad_extension_values_are_400(server, gpt):  # noqa: F811
    with pytest.raises(openai.BadRequestError, match="n is not a Responses API field") as e:
        gpt.responses.create(model=server.model, input="hi", extra_body={"n": 2})
    assert e.value.body["param"] == "n" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        gpt.responses.create(model=server.model, input="hi",
                             extra_body={"repetition_penalty": "lots"})
    assert e.value.body["param"] == "repetition_penalty"
    with pytest.raises(openai.BadRequestError) as e:
        gpt.responses.create(model=server.model, input="hi", extra_body={"mtp_coupled": 1})
    assert e.value.body["param"] == "mtp_coupled"


# --- the app over a scripted engine --------------------------------------------------------
def test_function_call_and_reasoning_items(scripted):  # noqa: F811
    gpt = openai.OpenAI(base_url=scripted.url + "/v1", api_key="secret-key", max_retries=0)
    kw = dict(model="scripted", tools=[WEATHER], reasoning={"effort": "medium"},
              input=[{"role": "user", "content": "Weather in Paris?"}])
    scripted.engine.scripts += [(THOUGHT_AND_CALL, "stop")] * 2
    r = gpt.responses.create(**kw)
    assert r.status == "completed"
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "Paris, so the weather tool."
    assert r.output_text == "Checking."
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    call = r.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed"
    prompt = scripted.tok.decode(scripted.engine.requests[-1].prompt)
    assert prompt.endswith("<think>\n") and "get_weather" in prompt  # effort: thinking on

    with gpt.responses.stream(**kw) as s:
        events = [e.type for e in s]
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert json.loads(final.output[2].arguments) == {"city": "Paris"}
    i = events.index("response.function_call_arguments.delta")
    assert events[i - 1] == "response.output_item.added"
    assert events[i + 1:i + 3] == ["response.function_call_arguments.done",
                                   "response.output_item.done"]
    assert "response.reasoning_text.delta" in events and events[-1] == "response.completed"

    # the round trip: the output items go back as input with the function's output and
    # render exactly as the same conversation in chat-completions form
    answer = "The tool says sunny.\n</think>\n\nIt is sunny."
    scripted.engine.scripts += [(answer, "stop")] * 2
    follow = gpt.responses.create(**dict(kw, input=kw["input"] + [
        o.model_dump(exclude_none=True) for o in r.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]))
    assert follow.output_text == "It is sunny."
    gpt.chat.completions.create(
        model="scripted", tools=[CHAT_WEATHER],
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "Checking.",
                   "reasoning_content": "Paris, so the weather tool.",
                   "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                       "name": "get_weather", "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}])
    responses_prompt, chat_prompt = (q.prompt for q in scripted.engine.requests[-2:])
    assert responses_prompt == chat_prompt


def test_parameters_auth_and_failure(scripted):  # noqa: F811
    gpt = openai.OpenAI(base_url=scripted.url + "/v1", api_key="secret-key", max_retries=0)
    scripted.engine.scripts.append(("fine", "stop"))
    gpt.responses.create(model="scripted", input="hi", max_output_tokens=9, temperature=0.5,
                         top_p=0.9, tools=[WEATHER], tool_choice="none")
    req = scripted.engine.requests[-1]
    assert req.max_tokens == 9 and (req.sampling.temperature, req.sampling.top_p) == (0.5, 0.9)
    assert "get_weather" not in scripted.tok.decode(req.prompt)  # tool_choice none
    scripted.engine.scripts.append(("fine", "stop"))
    gpt.responses.create(model="scripted", input="hi", temperature=0.8,
                         extra_body=dict(SAMPLED, top_k=7, mtp_coupled=True))
    s = scripted.engine.requests[-1].sampling
    assert (s.temperature, s.seed, s.top_k, s.min_p, s.coupled) == (0.8, 3, 7, 0.02, True)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.6, 0.4, 1.3)
    assert s.logit_bias == ((198, -100.0),)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=scripted.url + "/v1", api_key="wrong", max_retries=0) \
            .responses.create(model="scripted", input="hi")
    scripted.engine.scripts.append(("some text before it breaks",
                                    Failed(500, "Out of memory while generating")))
    events = list(gpt.responses.create(model="scripted", input="hi", stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed"
    assert "Out of memory" in events[-1].response.error.message


def test_instructions_and_leading_system_items_join():
    from mlx_mtp.server.openai_responses import ResponsesRequest, to_chat_request

    chat = to_chat_request(ResponsesRequest.model_validate({"instructions": "A", "input": [
        {"role": "developer", "content": "B"}, {"role": "user", "content": "hi"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]}))
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "A\n\nB"), ("user", "hi"), ("assistant", "")]
    last = chat.messages[-1]
    assert last.reasoning_content == "think" and last.tool_calls[0].id == "c1"
