"""The engine's logprob lists -> OpenAI's two logprob shapes (legacy completions and chat).

The engine gives `[(logprob, token_id)]` per generated (or prompt) token and, per token, a top list
`[(logprob, token_id)]` sorted best first. A prompt's first token has no logprob (None).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any

from rxf.entrypoints.openai.protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob

TokenLogprobs = Sequence[tuple[float | None, int]]
TopLists = Sequence[Sequence[tuple[float, int]]]
TokenStr = Callable[[int], str]

# JSON has no -inf: OpenAI reports impossible tokens as -9999.0, and so do we (NaN too).
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # written so NaN -> the floor


def token_str_fn(tokenizer: Any) -> TokenStr:
    """Each token's own text (special tokens kept), memoised for one response."""
    cache: dict[int, str] = {}

    def token_str(token_id: int) -> str:
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    return token_str


def _top_dict(top: Sequence[tuple[float, int]], token_str: TokenStr) -> dict[str, float]:
    out: dict[str, float] = {}
    for logprob, token_id in top:  # best first: two ids with one text keep the better logprob
        out.setdefault(token_str(token_id), finite(logprob))
    return out


def completion_logprobs(
    tokens: TokenLogprobs, tops: TopLists | None, token_str: TokenStr, offset: int,
    hidden: Container[int] = frozenset(),
) -> tuple[CompletionLogprobs, int]:
    """The legacy completions object for `tokens`, whose text starts at `offset` in the choice's
    text; returns it and the offset after its last token. Tokens in `hidden` (special tokens, where
    the choice's text skips them) are listed with their own text but take no room in the choice's."""
    out = CompletionLogprobs()
    for j, (logprob, token_id) in enumerate(tokens):
        text = token_str(token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        if token_id not in hidden:
            offset += len(text)
        if logprob is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(finite(logprob))
        out.top_logprobs.append(_top_dict(tops[j] if tops and j < len(tops) else (), token_str))
    return out, offset


def join_completion_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def _top(logprob: float, token_id: int, token_str: TokenStr) -> TopLogprob:
    text = token_str(token_id)
    return TopLogprob(token=text, logprob=finite(logprob), bytes=list(text.encode("utf-8")))


def chat_logprobs(
    tokens: TokenLogprobs, tops: TopLists | None, token_str: TokenStr
) -> list[ChatTokenLogprob]:
    """Chat's `logprobs.content` entries. `bytes` are the UTF-8 of the token's own decoded text
    (a token holding part of a character decodes to U+FFFD, whose bytes are reported)."""
    out = []
    for j, (logprob, token_id) in enumerate(tokens):
        head = _top(logprob if logprob is not None else LOGPROB_FLOOR, token_id, token_str)
        top = tops[j] if tops and j < len(tops) else ()
        out.append(
            ChatTokenLogprob(**head.model_dump(), top_logprobs=[_top(lp, t, token_str) for lp, t in top])
        )
    return out
