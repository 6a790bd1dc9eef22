"""One request, prepared once (issue 17 item 1): every front door builds its request in the same
function (`RequestPreparer.prepare`), which tokenizes and validates it once, and the engine runs
what it built; each rule means the same on every door.

- The routes in this process over a recording TokenizerManager (the real preparer, a tokenizer that
  counts its calls): `/generate` (one prompt, a batch, a stream), `/v1/completions` and
  `/v1/chat/completions` with n choices each tokenize and verify a prompt once, and submit
  prepared requests holding those ids.
- `Runtime` on the demo model: `generate` with n choices and `chat` tokenize and verify once.
- The three doors (native `/generate`, the OpenAI routes through the `openai` client, `Runtime`) on
  the demo model accept and refuse the same sampling values, for the same reason, each naming the
  field as its request names it.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from rxf.core.config import load_config
from rxf.core.frontend.outputs import GenerateOutput
from rxf.core.frontend.request_preparer import RequestPreparer
from rxf.core.frontend.requests import RequestError
from rxf.core.ipc.messages import FinishReason, PreparedRequest
from rxf.core.sampling_params import SamplingParams
from rxf.entrypoints.http_errors import install_error_handlers
from rxf.entrypoints.native_routes import router as native_router
from rxf.entrypoints.openai.serving_chat import router as chat_router
from rxf.entrypoints.openai.serving_completions import router as completions_router
from rxf.entrypoints.server_state import ServerState
from rxf.plugins.chat_templates.base import HFChatTemplate
from rxf.testing import make_tiny_tokenizer

CTX, VOCAB = 256, 512
PROMPT = "The capital of France is"


class CountingTokenizer:
    """A tokenizer that counts its `encode` calls (everything else is the wrapped one's)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.encodes = tokenizer, 0

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        self.encodes += 1
        return self.tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


class RecordingTM:
    """Stands in for the TokenizerManager: keeps what it is asked to run, answers each with a token."""

    def __init__(self, preparer: RequestPreparer) -> None:
        self.preparer, self.submitted = preparer, []
        self.max_context_len, self.vocab_size = preparer.max_context_len, preparer.vocab_size

    def check_capacity(self, n: int = 1) -> None:
        pass

    def check_rids(self, rids: list[str]) -> None:
        pass

    async def generate(self, req: PreparedRequest):
        assert isinstance(req, PreparedRequest)
        self.submitted.append(req)
        yield GenerateOutput(req.rid, "ok", [7], len(req.input_ids), 1, 0, FinishReason("length"))


@pytest.fixture
def verifies(monkeypatch) -> list[SamplingParams]:
    """Every SamplingParams verified in this process, in order."""
    seen: list[SamplingParams] = []
    verify = SamplingParams.verify

    def counting(self: SamplingParams, vocab_size: int | None = None) -> None:
        seen.append(self)
        verify(self, vocab_size)

    monkeypatch.setattr(SamplingParams, "verify", counting)
    return seen


@pytest.fixture
def app():
    tok = make_tiny_tokenizer(VOCAB)
    counting = CountingTokenizer(tok)
    tm = RecordingTM(RequestPreparer(counting, CTX, VOCAB))
    app = FastAPI()
    for router in (native_router, completions_router, chat_router):
        app.include_router(router)
    install_error_handlers(app)
    app.state.server = ServerState(
        config=load_config({"model": {"path": "unused"}}), served_model_name="m", ready=True, tokenizer=tok,
        chat_template=HFChatTemplate(tok), tokenizer_manager=tm,  # type: ignore[arg-type]
    )
    with TestClient(app) as http:
        yield http, tm, counting


def test_generate_prepares_each_prompt_once(app, verifies):
    http, tm, tok = app
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert (tok.encodes, len(verifies), len(tm.submitted)) == (1, 1, 1)
    assert tm.submitted[0].input_ids == tok.tokenizer.encode(PROMPT)
    assert tm.submitted[0].sampling_params is verifies[0]  # the engine runs what was verified

    texts = ["a b", "c d e", "f"]
    r = http.post("/generate", json={"text": texts, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and len(r.json()) == 3, r.text
    assert (tok.encodes, len(verifies)) == (1 + 3, 1 + 3)
    assert [p.input_ids for p in tm.submitted[1:]] == [tok.tokenizer.encode(t) for t in texts]

    with http.stream("POST", "/generate", json={"text": PROMPT, "stream": True}) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    assert (tok.encodes, len(verifies), len(tm.submitted)) == (5, 5, 5)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_routes_prepare_a_prompt_once_for_all_its_choices(app, verifies, route):
    http, tm, tok = app
    body: dict[str, Any] = {"model": "m", "n": 3, "seed": 5, "max_tokens": 2}
    body |= {"prompt": PROMPT} if route == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    r = http.post(route, json=body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
    assert (tok.encodes, len(verifies)) == (1, 1)
    warm, *choices = tm.submitted  # the prompt's prefill, then its choices sharing it
    assert warm.sampling_params.max_new_tokens == 0 and len(choices) == 3
    assert all(c.input_ids == warm.input_ids for c in choices)
    assert [c.sampling_params.seed for c in choices] == [5, 6, 7]


def test_a_refused_request_reaches_nothing(app, verifies):
    http, tm, tok = app
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {"temperature": -1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.temperature", r.text
    assert tok.encodes == 0 and tm.submitted == []  # the parameters are checked before tokenizing


# ---- through Runtime, on the demo model ----
@pytest.fixture(scope="module")
def rt(demo_runtime):
    return demo_runtime


def test_runtime_prepares_a_prompt_once(rt, verifies, monkeypatch):
    calls: list[Any] = []
    encode = rt.tokenizer.encode

    def counting(*args: Any, **kwargs: Any) -> list[int]:
        calls.append(args)
        return encode(*args, **kwargs)

    monkeypatch.setattr(rt.tokenizer, "encode", counting)
    outs = rt.generate(PROMPT, {"max_new_tokens": 2, "temperature": 0.7, "seed": 1}, n=3)
    assert len(outs) == 3 and (len(calls), len(verifies)) == (1, 1)
    rt.chat([{"role": "user", "content": "Hi"}], {"max_new_tokens": 2}, n=2)
    assert (len(calls), len(verifies)) == (2, 2)


# ---- the same rule on every door, on the demo model ----
@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server


# (native field, value, accepted?) The OpenAI request names the field the same, but max_new_tokens
# (max_tokens); the OpenAI API's own temperature cap of 2 is not applied (vLLM and SGLang do not).
CASES = [
    ("temperature", 2.5, True),
    ("temperature", 100.5, False),
    ("temperature", -0.5, False),
    ("top_p", 0.0, False),
    ("top_k", -2, False),
    ("min_p", 1.5, False),
    ("repetition_penalty", 2.5, False),
    ("presence_penalty", -2.5, False),
    ("frequency_penalty", 2.0, True),
    ("seed", 2**64 - 1, True),
    ("seed", 2**64, False),
    ("max_new_tokens", 10**6, False),
]
OPENAI_NAME = {"max_new_tokens": "max_tokens"}
BASE = {"max_new_tokens": 1, "temperature": 0}


def _native(http, name: str, value: Any) -> str | None:
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": BASE | {name: value}})
    if r.status_code == 200:
        return None
    assert r.status_code == 400 and r.json()["error"]["param"] == f"sampling_params.{name}", r.text
    return r.json()["error"]["message"].removeprefix(f"sampling_params.{name}: ")


def _openai(client, model: str, name: str, value: Any) -> str | None:
    field = OPENAI_NAME.get(name, name)
    fields = {"max_tokens": 1, "temperature": 0} | {field: value}
    extensions = {key: fields.pop(key) for key in ("top_k", "min_p", "repetition_penalty") if key in fields}
    try:
        client.completions.create(model=model, prompt=PROMPT, extra_body=extensions, **fields)
    except openai.BadRequestError as err:
        assert err.body["param"] == field, err.body
        return err.body["message"].removeprefix(f"{field}: ")
    return None


def _runtime(rt, name: str, value: Any) -> str | None:
    try:
        rt.generate(PROMPT, BASE | {name: value})
    except RequestError as err:
        assert str(err).startswith(f"sampling_params.{name}: "), err
        return str(err).removeprefix(f"sampling_params.{name}: ")
    return None


@pytest.mark.parametrize(("name", "value", "accepted"), CASES, ids=[f"{n}={v}" for n, v, _ in CASES])
def test_every_door_takes_a_value_the_same_way(http, client, model, rt, name, value, accepted):
    native = _native(http, name, value)
    assert (native is None) == accepted, native
    assert _openai(client, model, name, value) == native
    assert _runtime(rt, name, value) == native
