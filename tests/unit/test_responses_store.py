"""The store of /v1/responses: bounded by entries and by characters (the oldest go first) and by a
TTL, on a fake clock."""

from __future__ import annotations

from rxf.entrypoints.openai.responses_protocol import ResponseObject
from rxf.entrypoints.openai.responses_store import ResponseStore


def response(response_id: str) -> ResponseObject:
    return ResponseObject(
        id=response_id, created_at=0, status="completed", model="m", output=[], temperature=1.0, top_p=1.0,
        tools=[], tool_choice="auto", parallel_tool_calls=True, text={"format": {"type": "text"}}, store=True,
    )


def put(store: ResponseStore, response: ResponseObject, conversation: list[dict]) -> None:
    store.put(response.id, response.model_dump_json(), conversation)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_oldest_entries_go_first():
    store = ResponseStore(max_entries=2, ttl_s=100, max_chars=10**6, clock=Clock())
    for i in range(3):
        put(store, response(f"r{i}"), [{"role": "user", "content": str(i)}])
    assert len(store) == 2 and store.get("r0") is None
    assert store.get("r2").conversation == [{"role": "user", "content": "2"}]
    assert store.delete("r1") and not store.delete("r1") and store.get("r1") is None


def test_entries_expire_after_the_ttl():
    clock = Clock()
    store = ResponseStore(max_entries=10, ttl_s=5, max_chars=10**6, clock=clock)
    put(store, response("a"), [])
    clock.now = 3
    put(store, response("b"), [])
    clock.now = 5.5
    assert store.get("a") is None and store.get("b") is not None
    clock.now = 8.5
    assert store.get("b") is None and len(store) == 0


def test_zero_entries_stores_nothing():
    store = ResponseStore(max_entries=0, ttl_s=5, max_chars=10**6, clock=Clock())
    put(store, response("a"), [])
    assert store.get("a") is None and len(store) == 0


def test_entries_are_bounded_by_their_characters():
    own = len(response("a").model_dump_json())  # the response object's JSON counts too
    store = ResponseStore(max_entries=10, ttl_s=100, max_chars=2 * own + 100, clock=Clock())
    turn = {"role": "user", "content": "x" * 36}  # 4 + 4 + 7 + 36 = 51 characters
    put(store, response("a"), [turn])
    put(store, response("b"), [turn])  # 2 * own + 102 > 2 * own + 100: "a" goes
    assert store.get("a") is None and store.get("b") is not None
    put(store, response("big"), [turn] * (own // 51 + 3))  # larger than the whole store: not kept, nothing dropped
    assert store.get("big") is None and store.get("b") is not None
    assert store.delete("b")
    put(store, response("c"), [turn])
    put(store, response("d"), [{"role": "user", "content": "y"}])
    assert store.get("c") is not None and store.get("d") is not None  # the deleted entry's count went back


def test_what_the_request_sent_beside_the_conversation_counts():
    # A 7 MB `user` (or instructions, a tool's description, a schema) on a one-token answer was stored
    # uncounted: 100 such requests held 700 MB against a 256 MB bound.
    store = ResponseStore(max_entries=10, ttl_s=100, max_chars=10_000, clock=Clock())
    put(store, response("small"), [])
    put(store, response("a").model_copy(update={"user": "u" * 20_000}), [])
    assert store.get("a") is None and store.get("small") is not None
    for i in range(4):
        put(store, response(f"r{i}").model_copy(update={"instructions": "i" * 3_000}), [])
    assert store.get("small") is None and store.get("r0") is None and store.get("r3") is not None
