"""Bad requests get an OpenAI error body with HTTP 400 (401 for a bad API key), and the server
keeps serving: after each bad request a good one still succeeds."""
from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "tiny-chat"
MSG = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather",
                                         "parameters": {"type": "object", "properties": {}}}}


def assert_openai_error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "param" in err and err["code"] == status
    assert "Traceback" not in err["message"]
    return err


def assert_still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG,
                                                "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def chat_body(**overrides) -> dict:
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **overrides}


def completion_body(**overrides) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **overrides}


CASES = {
    # name: (route, body, param the error should name, if any)
    "unknown model": ("chat", chat_body(model="gpt-9"), "model"),
    "negative max_tokens": ("chat", chat_body(max_tokens=-5), None),
    "zero max_completion_tokens": ("chat", chat_body(max_completion_tokens=0), None),
    "max_tokens beyond context": ("chat", chat_body(max_tokens=100_000), "max_tokens"),
    "chat prompt beyond context": (
        "chat", chat_body(messages=[{"role": "user", "content": "word " * 700}]), None),
    "completion prompt beyond context": ("completions", completion_body(prompt=[100] * 600),
                                         None),
    "tool without function name": (
        "chat", chat_body(tools=[{"type": "function", "function": {"description": "x"}}]),
        "tools.0.function.name"),
    "tool with bad function name": (
        "chat", chat_body(tools=[{"type": "function", "function": {"name": "no spaces!"}}]),
        None),
    "tool_choice of an unknown function": (
        "chat", chat_body(tools=[TOOL], tool_choice={"type": "function",
                                                      "function": {"name": "nope"}}),
        "tool_choice"),
    "tool_choice required without tools": ("chat", chat_body(tool_choice="required"),
                                           "tool_choice"),
    "temperature as a string": ("chat", chat_body(temperature="hot"), "temperature"),
    "negative temperature": ("chat", chat_body(temperature=-1), None),
    "messages not a list": ("chat", chat_body(messages="hello"), "messages"),
    "empty messages": ("chat", chat_body(messages=[]), "messages"),
    "unknown role": ("chat", chat_body(messages=[{"role": "wizard", "content": "x"}]), None),
    "n=0": ("chat", chat_body(n=0), None),
    "top_logprobs=50": ("chat", chat_body(logprobs=True, top_logprobs=50), "top_logprobs"),
    "top_p=0": ("chat", chat_body(top_p=0), None),
    "empty stop string": ("chat", chat_body(stop=[""]), None),
    "json_schema without a schema": ("chat", chat_body(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}}), None),
    "json_schema xgrammar rejects": ("chat", chat_body(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        "response_format"),
    "unknown response_format type": ("chat", chat_body(response_format={"type": "yaml"}),
                                     "response_format.type"),
    "completions logprobs=50": ("completions", completion_body(logprobs=50), None),
    "completions token id out of range": ("completions", completion_body(prompt=[10**9]),
                                          "prompt"),
    "completions empty prompt list": ("completions", completion_body(prompt=[]), None),
    "completions missing prompt": ("completions", {"model": MODEL}, "prompt"),
    "completions min_tokens > max_tokens": ("completions", completion_body(min_tokens=5),
                                            None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_gets_400(http, case):
    route, body, param = CASES[case]
    r = http.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body)
    err = assert_openai_error(r)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert_still_serving(http)


@pytest.mark.parametrize("payload", ['{"model": "tiny-chat", "messages": [', "not json at all",
                                     "[1, 2, 3]", ""])
def test_malformed_json(http, payload):
    r = http.post("/v1/chat/completions", content=payload,
                  headers={"content-type": "application/json"})
    assert_openai_error(r)
    assert_still_serving(http)


def test_bad_tokenizer_requests(http):
    assert_openai_error(http.post("/detokenize", json={"tokens": [-1]}))
    assert_openai_error(http.post("/tokenize", json={}))  # neither prompt nor messages
    assert_openai_error(http.post("/tokenize", json={"prompt": "a", "messages": MSG}))
    assert_still_serving(http)


def test_openai_client_raises_bad_request(client, tiny_server):
    before = tiny_server.metrics().get("deepinfer:bad_requests_total", 0.0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="gpt-9", messages=MSG, max_tokens=1)
    assert info.value.status_code == 400 and "gpt-9" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MSG, n=0)
    with pytest.raises(openai.BadRequestError):  # streaming requests are checked up front
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=-1, stream=True)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    assert tiny_server.metrics()["deepinfer:bad_requests_total"] == before + 4
    assert client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1).choices


# ---- --api-key -------------------------------------------------------------------------------
def test_api_key_required(auth_server):
    import openai as oa

    good = oa.OpenAI(base_url=auth_server.base_url, api_key=auth_server.api_key, max_retries=0,
                     timeout=60)
    model = good.models.list().data[0].id
    assert model == "tiny-auth"
    r = good.chat.completions.create(model=model, messages=MSG, max_tokens=2)
    assert r.usage.completion_tokens >= 1

    bad = oa.OpenAI(base_url=auth_server.base_url, api_key="wrong-key", max_retries=0,
                    timeout=60)
    with pytest.raises(oa.AuthenticationError) as info:
        bad.chat.completions.create(model=model, messages=MSG, max_tokens=2)
    assert info.value.status_code == 401
    with pytest.raises(oa.AuthenticationError):
        bad.models.list()

    with httpx.Client(base_url=auth_server.url, timeout=60) as raw:
        for headers in ({}, {"Authorization": "Bearer wrong-key"},
                        {"Authorization": auth_server.api_key},  # no Bearer
                        {"Authorization": f"Basic {auth_server.api_key}"}):
            err = assert_openai_error(raw.post("/v1/completions", headers=headers,
                                               json={"model": model, "prompt": "x",
                                                     "max_tokens": 1}), 401)
            assert err["type"] == "invalid_api_key"
        ok = raw.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1},
                      headers={"Authorization": f"Bearer {auth_server.api_key}"})
        assert ok.status_code == 200, ok.text
        assert raw.get("/health").status_code == 200  # probes need no key


def test_disconnect_with_api_key_frees_blocks(auth_server):
    """A client that gives up on a non-streaming request aborts it, also behind the API-key
    check (a BaseHTTPMiddleware there used to hide the disconnect)."""
    auth_server.wait_idle()
    before = auth_server.metrics().get("vllm:generation_tokens_total", 0.0)
    body = {"model": "tiny-auth", "prompt": "Go on:", "max_tokens": 450, "ignore_eos": True}
    with httpx.Client(timeout=1.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(f"{auth_server.base_url}/completions", json=body,
                   headers={"Authorization": f"Bearer {auth_server.api_key}"})
    auth_server.wait_idle(timeout=10.0)
    assert auth_server.metrics().get("vllm:generation_tokens_total", 0.0) - before < 450


def _schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {}}}} for i in range(n)]


LIMIT_CASES = {
    # name: (body, the flag the error names, the param)
    "too many tools": (chat_body(tools=_tools(513), tool_choice="required"), "--max-tools",
                       "tools"),
    "too many enum values": (chat_body(response_format=_schema_format(
        {"enum": list(range(4097))})), "--max-enum-values", "response_format"),
    "too many anyOf branches": (chat_body(response_format=_schema_format(
        {"anyOf": [{"const": i} for i in range(4097)]})), "--max-enum-values",
        "response_format"),
    "schema too large": (chat_body(response_format=_schema_format(
        {"type": "string", "description": "x" * (513 * 1024)})), "--max-schema-kb",
        "response_format"),
    "completion schema too large": (completion_body(response_format=_schema_format(
        {"type": "string", "description": "x" * (513 * 1024)})), "--max-schema-kb",
        "response_format"),
}


@pytest.mark.parametrize("case", list(LIMIT_CASES))
def test_constraint_limits_name_their_flag(http, case):
    body, flag, param = LIMIT_CASES[case]
    route = "chat/completions" if "messages" in body else "completions"
    err = assert_openai_error(http.post(f"/v1/{route}", json=body))
    assert flag in err["message"] and err["param"] == param, err


def test_prompt_length_is_checked_before_the_constraint(http):
    """A prompt over the context is refused before its constraint is compiled: the error is
    the length's, not the (invalid) schema's."""
    long = [{"role": "user", "content": "word " * 700}]
    for body in (chat_body(messages=long, response_format=_schema_format({"type": "nonsense"})),
                 chat_body(messages=long, tools=[TOOL], tool_choice="required")):
        err = assert_openai_error(http.post("/v1/chat/completions", json=body))
        assert "context length" in err["message"], err
    err = assert_openai_error(http.post("/v1/completions", json=completion_body(
        prompt=[100] * 600, response_format=_schema_format({"type": "nonsense"}))))
    assert "context length" in err["message"], err
