"""What the TokenizerManager yields for a request: typed `GenerateOutput`s, turned into the public
dict shape (`{"text", "output_ids", "meta_info"}`, as SGLang's `/generate` answers) only at the
edges (`Runtime`'s results, the native route's JSON) by `to_dict`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rxf.core.ipc.messages import FinishReason, StrOut

# (logprob, token id); a prompt's first token has no logprob (None).
TokenLogprob = tuple[float, int]
TopLogprobs = list[tuple[float, int]]


@dataclass
class Logprobs:
    """A request's logprobs in output order. The prompt's (`input_*`, when asked for with
    logprob_start_len >= 0) come with its first output only: None in the outputs after it."""

    output_token_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[TopLogprobs] | None = None

    @classmethod
    def of(cls, item: StrOut) -> Logprobs:
        """The logprobs one detokenizer output carries (the scheduler sends (token id, logprob))."""
        t = item.token
        out = cls(
            list(zip(t.output_token_logprobs or [], t.new_token_ids, strict=False)),
            [[(lp, tid) for tid, lp in top] for top in t.output_top_logprobs or []],
        )
        if t.input_token_logprobs is not None:
            out.input_token_logprobs = list(zip(t.input_token_logprobs, t.input_token_ids or [], strict=False))
            out.input_top_logprobs = [[(lp, tid) for tid, lp in top] for top in t.input_top_logprobs or []]
        return out

    def extend(self, later: Logprobs) -> None:
        self.output_token_logprobs += later.output_token_logprobs
        self.output_top_logprobs += later.output_top_logprobs
        if later.input_token_logprobs is not None:
            self.input_token_logprobs = (self.input_token_logprobs or []) + later.input_token_logprobs
            self.input_top_logprobs = (self.input_top_logprobs or []) + (later.input_top_logprobs or [])

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "output_token_logprobs": self.output_token_logprobs,
            "output_top_logprobs": self.output_top_logprobs,
        }
        if self.input_token_logprobs is not None:
            out["input_token_logprobs"] = self.input_token_logprobs
            out["input_top_logprobs"] = self.input_top_logprobs
        return out


def embedding_floats(data: bytes) -> list[float]:
    """An embedding as `TokenOut.embedding` carries it, as floats."""
    return np.frombuffer(data, "<f4").tolist()


@dataclass
class GenerateOutput:
    """A streamed chunk (`text` and `output_ids` are what it adds) or a final result (complete).
    The counts are the request's totals so far."""

    rid: str
    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason | None = None  # None while the request runs
    logprobs: Logprobs | None = None  # None unless the request asked for them
    # An embedding request's pooled vector (float32 little-endian bytes), with its final result.
    embedding: bytes | None = None
    spec_verify_ct: int = 0  # decode forwards with speculative decoding on (0: it was off)

    def to_dict(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason.to_json() if self.finish_reason else None,
        }
        if self.spec_verify_ct:  # accept length = completion_tokens / spec_verify_ct
            meta["spec_verify_ct"] = self.spec_verify_ct
        if self.logprobs is not None:
            meta |= self.logprobs.to_dict()
        if self.embedding is not None:
            return {"embedding": embedding_floats(self.embedding), "meta_info": meta}
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": meta}
