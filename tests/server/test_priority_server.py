"""Request priorities at the server's front doors, under scheduler.policy = "priority": the official
`openai` client sends `priority` with `extra_body` (as it does for vLLM), native /generate takes one
for all prompts or one per prompt, and a bad value is a 400 naming `priority`. (A nonzero priority
under another policy is refused: see COMPLETION_ERRORS in test_openai_api.py.)"""

from __future__ import annotations

from typing import Any

import openai
import pytest

GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def server(module_server_factory):
    return module_server_factory({"scheduler.policy": "priority"})


def test_openai_client_priority_is_accepted_and_changes_no_tokens(client, model, http):
    plain = client.completions.create(model=model, prompt="the cat", **GREEDY)
    for priority in (-7, 0, 2**31 - 1):
        out = client.completions.create(model=model, prompt="the cat", extra_body={"priority": priority}, **GREEDY)
        assert out.choices[0].text == plain.choices[0].text
    stream = client.completions.create(
        model=model, prompt="the cat", stream=True, extra_body={"priority": 3}, **GREEDY
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == plain.choices[0].text
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], n=2, extra_body={"priority": 5}, **GREEDY
    )
    assert [c.finish_reason for c in chat.choices] == ["length", "length"]
    assert http.get("/get_server_info").json()["config"]["scheduler"]["policy"] == "priority"


@pytest.mark.parametrize("value", ["1", 1.5, True, [1], 2**31, -(2**31) - 1])
def test_openai_bad_priority_is_400_naming_it(client, model, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", extra_body={"priority": value}, **GREEDY)
    assert info.value.body["param"] == "priority", info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], stream=True, extra_body={"priority": value},
            **GREEDY,
        )
    assert info.value.body["param"] == "priority", info.value.body


def test_native_generate_priority_per_prompt_or_for_all(http):
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    alone = [http.post("/generate", json={"text": t, "sampling_params": params}).json() for t in ("a b", "c d")]
    for priority in ([4, -4], 9):
        r = http.post("/generate", json={"text": ["a b", "c d"], "sampling_params": params, "priority": priority})
        assert r.status_code == 200, r.text
        assert [x["output_ids"] for x in r.json()] == [x["output_ids"] for x in alone]


@pytest.mark.parametrize(
    "body",
    [
        {"text": "a", "priority": 2**40},
        {"text": "a", "priority": "high"},
        {"text": "a", "priority": 1.0},
        {"text": ["a", "b"], "priority": [1]},  # one per prompt, or one for all
        {"text": "a", "priority": [1]},  # a list needs a batch
        {"text": "a", "priority": -(2**31) - 1, "stream": True},  # refused before the stream starts
    ],
)
def test_native_bad_priority_is_400_naming_it(http, body):
    r = http.post("/generate", json={"sampling_params": {"max_new_tokens": 2}, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority", r.json()
