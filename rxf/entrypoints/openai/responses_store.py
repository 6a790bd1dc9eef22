"""The stored responses of `/v1/responses` (`store: true`): what `GET /v1/responses/{id}` answers and
what `previous_response_id` continues, kept in the server's memory.

Bounded three ways: at most `server.responses_store_entries` responses, their size at most
`server.responses_store_max_mb` in all (the oldest go first, and one larger on its own is not kept),
and each for `server.responses_store_ttl_s` seconds after it was stored. A response is kept as the
JSON its creation replied with (written once: `GET` replies with the same text), far smaller than its
object when it carries logprobs. An entry's size is its conversation's text (images' data URLs
included) plus that JSON, which holds what
the request sent beside the conversation (`user`, `instructions`, `tools`, `text.format`'s schema,
metadata) and the output's logprobs: any of them may be megabytes. A response's conversation is the
previous one's list plus its own messages: the message dicts are shared between the entries of one
conversation, not copied; each entry is counted with its whole conversation, so the count is an
upper bound of the memory held.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


def text_size(value: Any) -> int:
    """The characters of the strings inside `value` (dicts, lists, strings)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + text_size(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(text_size(v) for v in value)
    return 0


@dataclass(frozen=True)
class StoredResponse:
    response_json: str
    conversation: list[dict[str, Any]]  # chat messages: the input (without instructions) and the output
    stored_at: float
    size: int  # characters: the conversation's text and the response's JSON


class ResponseStore:
    def __init__(
        self, max_entries: int, ttl_s: float, max_chars: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.max_chars = max_chars
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._chars = 0

    def _drop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._chars -= entry.size

    def _expire(self) -> None:
        # Entries are in storing order and share one TTL, so the expired ones are a prefix.
        deadline = self.clock() - self.ttl_s
        while self._entries and next(iter(self._entries.values())).stored_at <= deadline:
            self._drop_oldest()

    def put(self, response_id: str, response_json: str, conversation: list[dict[str, Any]]) -> None:
        self._expire()
        if self.max_entries == 0:
            return
        size = text_size(conversation) + len(response_json)
        if size > self.max_chars:
            logger.warning("response %s not stored: its %d characters exceed the store", response_id, size)
            return
        self._entries[response_id] = StoredResponse(response_json, conversation, self.clock(), size)
        self._chars += size
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            self._drop_oldest()

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._chars -= entry.size
        return True

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)
