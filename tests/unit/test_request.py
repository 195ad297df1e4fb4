"""Request parsing: validation errors, canonical prompts, routing keys, rid splicing."""

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.forward.outbound import body_with_rid
from gateway.routing.hashing import block_hashes
from gateway.routing.request import (
    ApiKind,
    RequestError,
    RequestSettings,
    RouteRequest,
    parse_request,
)

S = RequestSettings()


def parse(kind: ApiKind, obj: Any, headers: dict[str, str] | None = None) -> RouteRequest:
    return parse_request(kind, orjson.dumps(obj), headers or {}, S)


def chat(*contents: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": c} for c in contents], **extra}


# --- validation ----------------------------------------------------------------------

BAD_BODIES: list[tuple[ApiKind, bytes, str]] = [
    (ApiKind.CHAT, b"", "empty"),
    (ApiKind.CHAT, b"   ", "empty"),
    (ApiKind.CHAT, b"{not json", "JSON"),
    (ApiKind.CHAT, b'{"messages": "\xff\xfe"}', "JSON"),
    (ApiKind.CHAT, b"[1, 2]", "object"),
    (ApiKind.CHAT, b'"text"', "object"),
]


@pytest.mark.parametrize(("kind", "body", "needle"), BAD_BODIES)
def test_bad_bodies(kind: ApiKind, body: bytes, needle: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_request(kind, body, {}, S)
    assert err.value.status == 400
    assert needle in err.value.message
    assert err.value.err_type == "invalid_request_error"


BAD_FIELDS: list[tuple[ApiKind, dict[str, Any], str]] = [
    (ApiKind.CHAT, {}, "messages"),
    (ApiKind.CHAT, {"messages": []}, "messages"),
    (ApiKind.CHAT, {"messages": "hi"}, "messages"),
    (ApiKind.CHAT, {"messages": ["hi"]}, "messages[0]"),
    (ApiKind.CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role"),
    (ApiKind.CHAT, {"messages": [{"role": 3, "content": "hi"}]}, "messages[0].role"),
    (ApiKind.CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (ApiKind.CHAT, {"messages": [{"role": "user", "content": [3]}]}, "messages[0].content"),
    (
        ApiKind.CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content[0].text",
    ),
    (ApiKind.CHAT, chat("x", tools={"a": 1}), "tools"),
    (ApiKind.CHAT, chat("x", stream="yes"), "stream"),
    (ApiKind.CHAT, chat("x", stream=1), "stream"),
    (ApiKind.CHAT, chat("x", model=7), "model"),
    (ApiKind.CHAT, chat("x", max_tokens="10"), "max_tokens"),
    (ApiKind.CHAT, chat("x", max_tokens=True), "max_tokens"),
    (ApiKind.CHAT, chat("x", max_tokens=-1), "max_tokens"),
    (ApiKind.CHAT, chat("x", max_completion_tokens=1.5), "max_completion_tokens"),
    (ApiKind.CHAT, chat("x", n="2"), "n"),
    (ApiKind.CHAT, chat("x", temperature="hot"), "temperature"),
    (ApiKind.CHAT, chat("x", stream_options=[1]), "stream_options"),
    (ApiKind.CHAT, chat("x", stream_options={"include_usage": "y"}), "include_usage"),
    (ApiKind.CHAT, chat("x", user=5), "user"),
    (ApiKind.CHAT, chat("x", cache_salt=5), "cache_salt"),
    (ApiKind.COMPLETIONS, {}, "prompt"),
    (ApiKind.COMPLETIONS, {"prompt": 5}, "prompt"),
    (ApiKind.COMPLETIONS, {"prompt": []}, "prompt"),
    (ApiKind.COMPLETIONS, {"prompt": ["a", 1]}, "prompt"),
    (ApiKind.COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
    (ApiKind.COMPLETIONS, {"prompt": [1, -2]}, "prompt"),
    (ApiKind.COMPLETIONS, {"prompt": [1, 2.5]}, "prompt"),
    (ApiKind.COMPLETIONS, {"prompt": [[1], []]}, "prompt"),
    (ApiKind.COMPLETIONS, {"prompt": [[1], "a"]}, "prompt"),
    (ApiKind.COMPLETIONS, {"prompt": [{"a": 1}]}, "prompt"),
    (ApiKind.GENERATE, {}, "text"),
    (ApiKind.GENERATE, {"text": 3}, "text"),
    (ApiKind.GENERATE, {"text": "a", "input_ids": [1]}, "text"),
    (ApiKind.GENERATE, {"input_ids": "abc"}, "input_ids"),
    (ApiKind.GENERATE, {"input_ids": [1, None]}, "input_ids"),
    (ApiKind.GENERATE, {"text": "a", "sampling_params": 3}, "sampling_params"),
    (ApiKind.GENERATE, {"text": "a", "sampling_params": {"max_new_tokens": "9"}}, "max_new"),
    (ApiKind.EMBEDDINGS, {}, "input"),
    (ApiKind.EMBEDDINGS, {"input": {"a": 1}}, "input"),
]


@pytest.mark.parametrize(("kind", "obj", "field"), BAD_FIELDS)
def test_bad_fields_name_the_field(kind: ApiKind, obj: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestError) as err:
        parse(kind, obj)
    assert err.value.status == 400
    assert field in err.value.message


def test_valid_minimal_requests() -> None:
    assert parse(ApiKind.CHAT, chat("hi")).kind is ApiKind.CHAT
    assert parse(ApiKind.COMPLETIONS, {"prompt": "hi"}).prompt_chars == 2
    assert parse(ApiKind.COMPLETIONS, {"prompt": ["ab", "cde"]}).prompt_chars == 5
    assert parse(ApiKind.GENERATE, {"text": "hi"}).kind is ApiKind.GENERATE
    assert parse(ApiKind.GENERATE, {"input_embeds": [[0.1]]}).block_hashes == []
    emb = parse(ApiKind.EMBEDDINGS, {"input": "x" * 200})
    assert emb.block_hashes == [] and emb.prompt_tokens == 50


def test_fields_extracted() -> None:
    body = chat(
        "x" * 400, model="m", stream=True, stream_options={"include_usage": True}, rid="r-1"
    )
    req = parse(ApiKind.CHAT, body)
    assert (req.model, req.stream, req.include_usage, req.rid) == ("m", True, True, "r-1")
    assert req.prompt_tokens == -(-req.prompt_chars // 4)
    assert len(req.block_hashes) == req.prompt_chars // 64
    assert req.body == orjson.dumps(body)
    plain = parse(ApiKind.CHAT, chat("x"))
    assert (plain.model, plain.stream, plain.include_usage, plain.rid) == (None, False, False, None)


def test_token_ids_are_exact_and_hash_like_packed_ids() -> None:
    ids = list(range(100))
    gen = parse(ApiKind.GENERATE, {"input_ids": ids})
    comp = parse(ApiKind.COMPLETIONS, {"prompt": ids})
    assert gen.prompt_tokens == 100 and gen.prompt_chars == 400
    assert len(gen.block_hashes) == 400 // 64
    assert gen.block_hashes == comp.block_hashes
    batch = parse(ApiKind.COMPLETIONS, {"prompt": [ids, [1, 2, 3]]})
    assert batch.prompt_tokens == 103 and batch.block_hashes == comp.block_hashes
    assert gen.matched_tokens(len(gen.block_hashes)) == 96


def test_chars_per_token_setting() -> None:
    settings_ = RequestSettings(chars_per_token=2.0, block_chars=32)
    req = parse_request(ApiKind.COMPLETIONS, b'{"prompt": "' + b"a" * 100 + b'"}', {}, settings_)
    assert req.prompt_tokens == 50 and len(req.block_hashes) == 3
    assert req.matched_tokens(3) == 48


# --- canonical chat text -------------------------------------------------------------

message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.one_of(
            st.text(max_size=120),
            st.none(),
            st.lists(
                st.one_of(
                    st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=60)),
                    st.builds(
                        lambda u: {"type": "image_url", "image_url": {"url": u}},
                        st.text(max_size=30),
                    ),
                ),
                max_size=3,
            ),
        ),
    },
    optional={
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {
                    "id": st.text(max_size=5),
                    "function": st.dictionaries(st.text(max_size=5), st.integers(-1000, 1000)),
                }
            ),
            max_size=2,
        )
    },
)


@settings(max_examples=40, deadline=None)
@given(st.lists(message, min_size=2, max_size=6), st.integers(1, 5))
def test_turn_k_text_is_prefix_of_turn_k_plus_1(messages: list[dict[str, Any]], k: int) -> None:
    k = min(k, len(messages) - 1)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    earlier = parse(ApiKind.CHAT, {"messages": messages[:k], "tools": tools})
    later = parse(ApiKind.CHAT, {"messages": messages, "tools": tools})
    assert later.block_hashes[: len(earlier.block_hashes)] == earlier.block_hashes
    assert later.prompt_chars >= earlier.prompt_chars


def test_roles_and_tools_matter() -> None:
    user = parse(ApiKind.CHAT, {"messages": [{"role": "user", "content": "x" * 300}]})
    system = parse(ApiKind.CHAT, {"messages": [{"role": "system", "content": "x" * 300}]})
    assert user.block_hashes[0] != system.block_hashes[0]
    with_tools = parse(ApiKind.CHAT, chat("x" * 300, tools=[{"name": "t"}]))
    assert with_tools.block_hashes[0] != user.block_hashes[0]


def test_tool_order_of_keys_is_irrelevant() -> None:
    a = parse(ApiKind.CHAT, chat("x" * 200, tools=[{"b": 1, "a": {"d": 2, "c": 3}}] * 3))
    b = parse(ApiKind.CHAT, chat("x" * 200, tools=[{"a": {"c": 3, "d": 2}, "b": 1}] * 3))
    assert a.block_hashes == b.block_hashes


def test_text_parts_equal_plain_string_and_images_are_stable() -> None:
    plain = parse(ApiKind.CHAT, chat("hello " * 40))
    parts = parse(
        ApiKind.CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hello " * 20}] * 2,
                }
            ]
        },
    )
    assert plain.block_hashes == parts.block_hashes

    def with_image(url: str) -> RouteRequest:
        content = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "q" * 200},
        ]
        return parse(ApiKind.CHAT, {"messages": [{"role": "user", "content": content}]})

    assert with_image("http://a/1.png").block_hashes == with_image("http://a/1.png").block_hashes
    assert (
        with_image("http://a/1.png").block_hashes[0] != with_image("http://a/2.png").block_hashes[0]
    )


def test_model_and_namespace_seed_the_chain() -> None:
    base = parse(ApiKind.CHAT, chat("x" * 300, model="a"))
    for variant in (
        chat("x" * 300, model="b"),
        chat("x" * 300, model="a", cache_salt="s"),
        chat("x" * 300, model="a", extra_key="k"),
        chat("x" * 300, model="a", lora_path="l"),
    ):
        assert not set(parse(ApiKind.CHAT, variant).block_hashes) & set(base.block_hashes)
    again = parse(ApiKind.CHAT, chat("x" * 300, model="a", temperature=0.5))
    assert again.block_hashes == base.block_hashes


def test_completion_text_hash_is_block_hash_of_prompt() -> None:
    text = "The quick brown fox. " * 20
    req = parse(ApiKind.COMPLETIONS, {"prompt": text, "model": "m"})
    assert len(req.block_hashes) == len(block_hashes(text))


# --- routing key ---------------------------------------------------------------------


def test_routing_key_from_headers_case_insensitive_then_user() -> None:
    assert parse(ApiKind.CHAT, chat("x"), {"X-Session-Id": "s1"}).routing_key == "s1"
    assert parse(ApiKind.CHAT, chat("x"), {"x-smg-routing-key": "k"}).routing_key == "k"
    both = parse(ApiKind.CHAT, chat("x", user="u"), {"X-SMG-Routing-Key": "k"})
    assert both.routing_key == "k"
    assert parse(ApiKind.CHAT, chat("x", user="u")).routing_key == "u"
    assert parse(ApiKind.CHAT, chat("x")).routing_key is None
    no_user = RequestSettings(routing_key_from_user=False)
    req = parse_request(ApiKind.CHAT, orjson.dumps(chat("x", user="u")), {}, no_user)
    assert req.routing_key is None


# --- rid -----------------------------------------------------------------------------

RID_BODIES = [
    b'{"messages":[{"role":"user","content":"hi"}]}',
    b'  {\n  "messages" : [ {"role":"user","content":"h\\u00e9 }"} ] ,"x": {"y": []}  }\n\n',
    b'{"prompt":"a","rid":null}',
    b'{"text":"caf\xc3\xa9"}\r\n',
]


def _with_rid(req: RouteRequest, rid: str) -> bytes:
    return body_with_rid(req.body, rid, has_rid=req.rid is not None or req.rid_in_body)


@pytest.mark.parametrize("body", RID_BODIES)
def test_body_with_rid_inserts_only_the_rid(body: bytes) -> None:
    kind = ApiKind.CHAT if b"messages" in body else ApiKind.COMPLETIONS
    if b'"text"' in body:
        kind = ApiKind.GENERATE
    req = parse_request(kind, body, {}, S)
    out = _with_rid(req, 'r-"1\\')
    parsed = orjson.loads(out)
    assert parsed["rid"] == 'r-"1\\'
    original = orjson.loads(body)
    assert {k: v for k, v in parsed.items() if k != "rid"} == {
        k: v for k, v in original.items() if k != "rid"
    }
    # byte-exact: removing the inserted bytes gives the original back
    close = body.rindex(b"}")
    assert out[:close] == body[:close]
    assert out.endswith(body[close:])
    inserted = out[close : len(out) - (len(body) - close)]
    assert inserted in (b',"rid":"r-\\"1\\\\"', b'"rid":"r-\\"1\\\\"')


def test_body_with_rid_on_empty_object() -> None:
    req = RouteRequest(ApiKind.GENERATE, None, False, False, 0, 0, [], None, None, b"{ }")
    assert _with_rid(req, "x") == b'{ "rid":"x"}'


def test_a_clients_rid_is_replaced_and_batches_are_marked() -> None:
    body = b'{"prompt":"a","rid":"mine"}'
    req = parse_request(ApiKind.COMPLETIONS, body, {}, S)
    assert req.rid == "mine" and orjson.loads(_with_rid(req, "ours"))["rid"] == "ours"
    batch = b'{"text":["a","b"],"rid":["r1","r2"]}'
    req = parse_request(ApiKind.GENERATE, batch, {}, S)
    assert req.rid is None and req.batch  # the router leaves a batch's body as it came
    assert not parse_request(ApiKind.GENERATE, b'{"text":"a"}', {}, S).batch


def test_unknown_fields_untouched() -> None:
    body = b'{"messages":[{"role":"user","content":"hi"}],"weird":{"nested":[1,2,3]}}'
    assert parse_request(ApiKind.CHAT, body, {}, S).body is body


def test_batch_lora_list_is_a_namespace() -> None:
    text = ["x" * 300, "y" * 300]
    plain = parse(ApiKind.GENERATE, {"text": text})
    lora = parse(ApiKind.GENERATE, {"text": text, "lora_path": ["a", "b"], "rid": ["1", "2"]})
    assert plain.prompt_chars == lora.prompt_chars == 600
    assert not set(plain.block_hashes) & set(lora.block_hashes)
