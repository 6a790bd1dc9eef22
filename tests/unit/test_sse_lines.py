"""Every SSE writer of the server keeps an event on its `data:` line for readers that split with
`str.splitlines` (httpx's `iter_lines`): U+0085, U+2028 and U+2029 in generated text are escaped, and
the JSON decodes to the same text (`rxf/entrypoints/sse_lines.py`)."""

from __future__ import annotations

import json

import httpx

from rxf.entrypoints.native_routes import _sse
from rxf.entrypoints.openai.protocol import CompletionChoice, CompletionChunk
from rxf.entrypoints.openai.responses_stream import _Events
from rxf.entrypoints.openai.sse import event

TEXT = "a\x85b\u2028c\u2029d\ne\rf"  # the last two JSON escapes itself


def _events(stream: str) -> list[str]:
    """The `data:` payloads as httpx's line reader returns them."""
    lines = httpx.Response(200, content=stream.encode()).iter_lines()
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_native_event_is_one_line():
    (payload,) = _events(_sse({"text": TEXT}))
    assert json.loads(payload) == {"text": TEXT}


def test_openai_event_is_one_line():
    chunk = CompletionChunk(id="c", created=0, model="m", choices=[CompletionChoice(index=0, text=TEXT)])
    (payload,) = _events(event(chunk))
    assert json.loads(payload)["choices"][0]["text"] == TEXT


def test_responses_event_is_one_line():
    (payload,) = _events(_Events().event("response.output_text.delta", delta=TEXT))
    assert json.loads(payload)["delta"] == TEXT


def test_without_the_escapes_the_reader_cuts_the_event():
    """The failure the escapes prevent (so the tests above can fail)."""
    raw = f"data: {json.dumps({'text': TEXT}, ensure_ascii=False)}\n\n"
    assert len(_events(raw)) == 1 and len(list(httpx.Response(200, content=raw.encode()).iter_lines())) > 2
