"""Agent frameworks and client libraries as the caller, end to end against a real server.

openai-agents, LangChain, litellm and instructor each drive the `tools` server (tests/serve/
conftest.py: random weights, a Hermes-style template that renders tools, tool calls and tool
results) the way an application would. A random-weight model writes nothing meaningful, so the
tests force the calls (tool_choice "required" or named) and give every tool argument a finite
set of values (enums, booleans): what the model writes is then bounded by the call's schema,
and each loop ends after a known number of rounds. What is checked is the protocol: requests the
libraries build are accepted, and their answers parse into the libraries' own objects (tool
calls with arguments valid for the tool, validated pydantic objects).

The libraries are kept off the network: tracing, telemetry and remote price maps are off.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import pytest
from conftest import openai_client
from pydantic import BaseModel

MODEL = "tiny-tools"
TIMEOUT_S = 300.0  # two busy cores may hold a request long; nothing here waits on purpose
City = Literal["Paris", "Oslo"]


class Place(BaseModel):
    city: City


class Trip(BaseModel):
    """A nested model: its JSON schema refers to Place through $defs."""
    origin: Place
    by_train: bool


@pytest.fixture(scope="module", autouse=True)
def offline_libraries():
    """What each library reads from the environment to stay off the network."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
        env.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # read when litellm is imported
        env.setenv("LITELLM_TELEMETRY", "False")
        for name in ("LANGCHAIN_TRACING_V2", "LANGSMITH_TRACING", "LANGCHAIN_API_KEY"):
            env.delenv(name, raising=False)
        yield


@dataclass
class Bodies:
    """The JSON bodies a client sent, read off its HTTP transport (what the server got)."""

    sent: list[dict] = field(default_factory=list)

    def hook(self, request: httpx.Request) -> None:
        if request.method == "POST":
            self.sent.append(json.loads(request.content))

    async def async_hook(self, request: httpx.Request) -> None:
        self.hook(request)

    def client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"request": [self.hook]}, timeout=TIMEOUT_S)

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"request": [self.async_hook]}, timeout=TIMEOUT_S)


def calls_and_results(messages: list[dict]) -> tuple[list[dict], dict[str, Any]]:
    """The assistant turns' tool calls and the tool results by call id, in a sent body."""
    calls = [c for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    results = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
    return calls, results


# ---- openai-agents ---------------------------------------------------------------------------
def test_openai_agents_runs_two_tool_rounds(tools_server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        ToolsToFinalOutputResult,
        function_tool,
    )
    from openai import AsyncOpenAI

    ran: list[tuple[str, Any]] = []  # the tools' own calls: the library parsed the arguments

    @function_tool
    def get_weather(city: City) -> str:
        """The weather in a city."""
        ran.append(("get_weather", city))
        return f"Sunny in {city}"

    @function_tool
    def get_time(utc: bool) -> str:
        """The time now."""
        ran.append(("get_time", utc))
        return "12:00 UTC" if utc else "13:00"

    rounds: list[list[str]] = []

    def end_after_two_rounds(_context, results) -> ToolsToFinalOutputResult:
        rounds.append([r.output for r in results])
        return ToolsToFinalOutputResult(is_final_output=len(rounds) == 2,
                                        final_output=" ".join(rounds[-1]))

    bodies = Bodies()
    client = AsyncOpenAI(base_url=tools_server.base_url, api_key="unused", max_retries=0,
                         http_client=bodies.async_client())
    agent = Agent(name="assistant", instructions="Answer with the tools.",
                  tools=[get_weather, get_time],
                  model=OpenAIChatCompletionsModel(MODEL, client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=200),
                  tool_use_behavior=end_after_two_rounds,
                  reset_tool_choice=False)  # keep "required" for the second round too
    result = asyncio.run(Runner.run(agent, "Weather in Paris, then the time?",
                                    run_config=RunConfig(tracing_disabled=True)))

    assert len(rounds) == 2 and len(ran) >= 2 and all(rounds), (rounds, ran)
    assert result.final_output == " ".join(rounds[1])
    assert len(bodies.sent) == 2  # one request per round, nothing retried
    # The second request carried the first round's call (content null beside tool_calls, as
    # agents send it) and its result, under the same call id.
    calls, results = calls_and_results(bodies.sent[1]["messages"])
    first = result.to_input_list()
    first_call = next(i for i in first if i.get("type") == "function_call")
    assert [c["id"] for c in calls] == [first_call["call_id"]]
    assert calls[0]["function"]["arguments"] == first_call["arguments"]
    assert results == {first_call["call_id"]: rounds[0][0]}
    assistant = next(m for m in bodies.sent[1]["messages"] if m["role"] == "assistant")
    assert assistant.get("content") is None


# ---- LangChain -------------------------------------------------------------------------------
def _langchain_model(server, bodies: Bodies, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=server.base_url, api_key="unused", temperature=0,
                      max_retries=0, http_client=bodies.client(), **kwargs)


def test_langchain_tool_rounds_then_an_answer(tools_server):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: City) -> str:
        """The weather in a city."""
        return f"Sunny in {city}"

    @tool
    def get_time(utc: bool) -> str:
        """The time now."""
        return "12:00 UTC" if utc else "13:00"

    tools = {t.name: t for t in (get_weather, get_time)}
    bodies = Bodies()
    llm = _langchain_model(tools_server, bodies, max_tokens=200)
    messages: list = [HumanMessage("Weather in Paris, then the time?")]
    for _ in range(2):
        reply = llm.bind_tools(list(tools.values()), tool_choice="required").invoke(messages)
        assert isinstance(reply, AIMessage) and reply.tool_calls, reply
        assert not reply.invalid_tool_calls, reply.invalid_tool_calls
        messages.append(reply)
        for call in reply.tool_calls:  # the tool validates the arguments against its schema
            result = tools[call["name"]].invoke(call)
            assert isinstance(result, ToolMessage) and result.status == "success", result
            messages.append(result)
    final = llm.bind_tools(list(tools.values()), tool_choice="none").invoke(
        messages, max_tokens=8)
    assert isinstance(final.content, str) and final.content and not final.tool_calls

    assert len(bodies.sent) == 3
    calls, results = calls_and_results(bodies.sent[2]["messages"])
    sent_ids = [c["id"] for c in calls]
    made_ids = [c["id"] for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    assert sent_ids == made_ids and set(results) == set(made_ids)


def test_langchain_structured_output_of_a_nested_model(tools_server):
    bodies = Bodies()
    llm = _langchain_model(tools_server, bodies, max_tokens=200)
    trip = llm.with_structured_output(Trip).invoke("Plan a trip.")
    assert isinstance(trip, Trip)
    schema = bodies.sent[0]["response_format"]["json_schema"]["schema"]
    assert "Place" in schema["$defs"]  # the nested model came as a definition


# ---- litellm ---------------------------------------------------------------------------------
def test_litellm_plain_streamed_and_forced_tool_call(tools_server):
    import litellm

    kw = dict(model=f"openai/{MODEL}", api_base=tools_server.base_url, api_key="unused",
              messages=[{"role": "user", "content": "Say hello."}], temperature=0)
    reference = openai_client(tools_server).chat.completions.create(
        model=MODEL, messages=kw["messages"], temperature=0, max_tokens=6)
    plain = litellm.completion(max_tokens=6, **kw)
    assert plain.choices[0].message.content == reference.choices[0].message.content
    assert plain.usage.completion_tokens == reference.usage.completion_tokens == 6

    chunks = list(litellm.completion(max_tokens=6, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == reference.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == \
        ["length"]

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": Place.model_json_schema()}}
    forced = litellm.completion(max_tokens=100, tools=[weather], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}, **kw)
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    Place.model_validate_json(call.function.arguments)


# ---- instructor ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_a_validated_nested_model(tools_server, mode):
    import instructor
    from openai import OpenAI

    bodies = Bodies()
    client = instructor.from_openai(
        OpenAI(base_url=tools_server.base_url, api_key="unused", max_retries=0,
               http_client=bodies.client()), mode=getattr(instructor.Mode, mode))
    trip = client.chat.completions.create(
        model=MODEL, response_model=Trip, max_retries=0, temperature=0, max_tokens=200,
        messages=[{"role": "user", "content": "Plan a trip."}])
    assert isinstance(trip, Trip)
    [body] = bodies.sent  # valid at the first try: nothing was asked again
    schema = body["tools"][0]["function"]["parameters"] if mode == "TOOLS" \
        else body["response_format"]["json_schema"]["schema"]
    assert "Place" in schema["$defs"]


# ---- an agent's tool turn, as the template renders it ----------------------------------------
def test_null_content_tool_turn_renders_as_the_template_does(tools_server):
    """The turn agents send back after a call (content null beside tool_calls, then the tool's
    result) is accepted, and the prompt is the checkpoint template's own rendering of it
    (transformers renders the reference)."""
    import transformers

    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]
    with httpx.Client(base_url=tools_server.url, timeout=TIMEOUT_S) as http:
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5})
        assert r.status_code == 200, r.text
        ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    checkpoint = tools_server.args[tools_server.args.index("--model") + 1]
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    reference = tokenizer.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=True)
    assert "<tool_response>\nSunny\n</tool_response>" in reference
    assert ids == tokenizer.encode(reference, add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
