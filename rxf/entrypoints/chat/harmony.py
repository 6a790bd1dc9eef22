"""The harmony format of gpt-oss, as its output reads: a sequence of messages, each

    [<|start|>assistant[ to=RECIPIENT]]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY END

with END one of `<|end|>`, `<|call|>` (a tool call), `<|return|>` (the last message). The first
message's `<|start|>assistant` is the prompt's. Channels: `analysis` (reasoning), `commentary`
(tool calls, addressed `to=functions.NAME`, and preambles the user sees) and `final` (the answer).
The markers are special tokens, so the output is detokenized with them.

`read_messages` is prefix-stable: a message appears once its header is whole (`<|message|>`
arrived), and its body only grows, holding back the start of a marker at its end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, "<|constrain|>")
_TERMINATORS = (END, CALL, RETURN, START)  # a <|start|> without an end also ends the message
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str  # "" when the header names none
    recipient: str | None  # "functions.get_weather" for a tool call
    body: str
    closed: bool
    raw: str  # the message's text, header and end marker included

    @property
    def function(self) -> str | None:
        """The function a tool call addresses (None: not a call)."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient.removeprefix(FUNCTIONS)


def held_marker(text: str) -> int:
    """Length of the longest end of `text` that begins a marker."""
    for k in range(min(len(text), max(map(len, MARKERS))), 0, -1):
        if any(marker.startswith(text[-k:]) for marker in MARKERS):
            return k
    return 0


def is_harmony(text: str) -> bool | None:
    """Whether `text` is harmony messages: None while its start could still become a header."""
    head = text.lstrip()
    if head.startswith((START, CHANNEL)):
        return True
    return None if any(m.startswith(head) for m in (START, CHANNEL)) else False


def read_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of `text` so far (the last one may be open)."""
    messages: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        header_end = text.find(MESSAGE, pos)
        if header_end == -1:
            return messages  # a header still arriving (or trailing text without one)
        header = text[pos:header_end]
        body_start = header_end + len(MESSAGE)
        ends = [(i, marker) for marker in _TERMINATORS if (i := text.find(marker, body_start)) != -1]
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        info = (channel.group(1) if channel else "", recipient.group(1) if recipient else None)
        if not ends:
            body = text[body_start:]
            if not final:
                body = body[: len(body) - held_marker(body)]
            messages.append(HarmonyMessage(*info, body, False, text[pos:]))
            return messages
        end, marker = min(ends)
        after = end if marker == START else end + len(marker)
        messages.append(HarmonyMessage(*info, text[body_start:end], True, text[pos:after]))
        pos = after
    return messages
