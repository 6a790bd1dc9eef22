"""The stored responses of `/v1/responses` (`store: true`): what `GET /v1/responses/{id}` answers and
what `previous_response_id` continues, kept in the server's memory.

Bounded twice: at most `server.responses_store_entries` responses (the oldest goes first) and each
for `server.responses_store_ttl_s` seconds after it was stored. A response's conversation is the
previous one's list plus its own messages: the message dicts are shared between the entries of one
conversation, not copied, so a chain of k turns holds each turn once (and k lists of references).
Every stored conversation fitted the model's context when it was served, which bounds each entry.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rxf.entrypoints.openai.responses_protocol import ResponseObject


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[dict[str, Any]]  # chat messages: the input (without instructions) and the output
    stored_at: float


class ResponseStore:
    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    def _expire(self) -> None:
        # Entries are in storing order and share one TTL, so the expired ones are a prefix.
        deadline = self.clock() - self.ttl_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.stored_at > deadline:
                break
            self._entries.popitem(last=False)

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        self._expire()
        if self.max_entries == 0:
            return
        self._entries[response.id] = StoredResponse(response, conversation, self.clock())
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)
