"""gpt-oss's harmony tool calls: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
{...}<|call|>` messages in the text that the harmony reasoning parser leaves as content (the
analysis channel is gone by then; other messages are plain text). The arguments stream as they
are written."""

from __future__ import annotations

from rxf.entrypoints.chat.harmony import CALL, CHANNEL, START, read_messages
from rxf.entrypoints.chat.tool_parsers.base import CallPiece, Piece, ToolCallParser
from rxf.entrypoints.chat.tool_parsers.json_scan import CallScan, skip_ws, value_end
from rxf.plugins.chat_templates.tools import HarmonySyntax


class HarmonyToolParser(ToolCallParser):
    name = "harmony"
    markers = (CHANNEL, START)
    syntax = HarmonySyntax()
    needs_special_tokens = True

    def pieces(self, text: str) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while (start := min((i for m in (START, CHANNEL) if (i := text.find(m, pos)) != -1), default=-1)) != -1:
            pieces.append(text[pos:start])
            messages = read_messages(text[start:], final=False)
            if not messages:  # its header is still arriving
                return [*pieces, CallPiece(CallScan(), text[start:], closed=False)]
            message = messages[0]
            if message.function is None:
                pieces.append(message.body)
            else:
                i = skip_ws(message.body, 0)
                end = value_end(message.body, i)
                arguments = message.body[i : len(message.body) if end is None else end]
                done = message.closed and message.raw.endswith(CALL)
                call = CallScan(name=message.function, arguments=arguments or ("{}" if done else ""))
                pieces.append(CallPiece(call, message.raw, closed=message.closed))
            if not message.closed:
                return pieces
            pos = start + len(message.raw)
        pieces.append(text[pos:])
        return pieces
