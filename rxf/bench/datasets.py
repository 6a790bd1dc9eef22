"""Benchmark workloads: lists of `BenchRequest` (prompt text, its token count, output budget).

- random: prompts of a controlled token count under the target tokenizer;
- shared-prefix: groups of prompts that share one long system prompt, each with its own question
  (the "generated shared prefix" design: what a prefix cache can reuse is known exactly);
- sharegpt-file: the first human turn of each conversation in a local ShareGPT-format JSON file
  (never downloaded).

Every generator is deterministic in its `random.Random`; the same seed and tokenizer give the same
prompts, so different servers see identical work.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A few re-encoding rounds always reached the exact length in practice; more means the tokenizer
# keeps merging across our token boundaries and we give up loudly rather than return a wrong length.
_MAX_FIX_ROUNDS = 20
_MIN_WORD_TOKENS = 64


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens under the benchmark's tokenizer, without special tokens
    output_len: int  # max new tokens (exact with ignore_eos)


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


class TokenSampler:
    """Builds texts of an exact token count from the tokenizer's own vocabulary.

    It draws from "word" tokens (a space then letters) that encode back to themselves: a
    byte-level BPE splits on spaces before merging, so a concatenation of such tokens re-encodes
    to the same ids. Tokenizers with too few of them fall back to every round-tripping token, and
    the length is then fixed up by re-encoding."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []))
        words: list[int] = []
        others: list[int] = []
        for tid in range(len(tokenizer)):
            if tid in special:
                continue
            text = tokenizer.decode([tid])
            if not text.strip() or _encode(tokenizer, text) != [tid]:
                continue
            (words if len(text) > 2 and text[0] == " " and text[1:].isalpha() else others).append(tid)
        self.pool = words if len(words) >= _MIN_WORD_TOKENS else words + others
        if not self.pool:
            raise ValueError("the tokenizer has no token that encodes back to itself")

    def text(self, n: int, rng: random.Random) -> str:
        """A text that encodes to exactly `n` tokens (without special tokens)."""
        if n <= 0:
            return ""
        ids = [rng.choice(self.pool) for _ in range(n)]
        for _ in range(_MAX_FIX_ROUNDS):
            text = self.tokenizer.decode(ids)
            got = _encode(self.tokenizer, text)
            if len(got) == n:
                return text
            ids = got[:n] + [rng.choice(self.pool) for _ in range(n - len(got))]
        raise ValueError(f"could not build a {n}-token text with this tokenizer")


def _length(mean: int, range_ratio: float, rng: random.Random) -> int:
    """Uniform in [mean*(1-r), mean*(1+r)], at least 1; r=0 gives exactly `mean`."""
    low = max(1, round(mean * (1 - range_ratio)))
    high = max(low, round(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def random_requests(
    tokenizer: Any, num: int, input_len: int, output_len: int, range_ratio: float, rng: random.Random
) -> list[BenchRequest]:
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError("range_ratio must be in [0, 1]")
    sampler = TokenSampler(tokenizer)
    out = []
    for _ in range(num):
        n_in = _length(input_len, range_ratio, rng)
        out.append(BenchRequest(sampler.text(n_in, rng), n_in, _length(output_len, range_ratio, rng)))
    return out


def shared_prefix_requests(
    tokenizer: Any,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    rng: random.Random,
) -> list[BenchRequest]:
    """`num_groups` system prompts, each followed by `prompts_per_group` different questions,
    shuffled. Every prompt is exactly system_prompt_len + question_len tokens and starts with its
    group's system_prompt_len token ids: a question whose first token would merge with the end of
    the prefix is drawn again (with word tokens that never happens)."""
    sampler = TokenSampler(tokenizer)
    out = []
    for _ in range(num_groups):
        prefix = sampler.text(system_prompt_len, rng)
        prefix_ids = _encode(tokenizer, prefix)
        for _ in range(prompts_per_group):
            for _ in range(_MAX_FIX_ROUNDS):
                prompt = prefix + sampler.text(question_len, rng)
                ids = _encode(tokenizer, prompt)
                if ids[:system_prompt_len] == prefix_ids and len(ids) == system_prompt_len + question_len:
                    break
            else:
                raise ValueError("could not build a question that keeps the prefix's tokens")
            out.append(BenchRequest(prompt, len(ids), output_len))
    rng.shuffle(out)
    return out


def sharegpt_requests(
    path: str | Path, tokenizer: Any, num: int, output_len: int | None = None, min_prompt_len: int = 4
) -> list[BenchRequest]:
    """The first `num` usable conversations in file order (a human turn, then a gpt turn). The
    output budget is the gpt turn's token count unless `output_len` fixes it."""
    data: list[dict[str, Any]] = json.loads(Path(path).read_text())
    out: list[BenchRequest] = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        prompt, answer = turns[0]["value"], turns[1]["value"]
        n_in = len(_encode(tokenizer, prompt))
        n_out = output_len if output_len is not None else len(_encode(tokenizer, answer))
        if n_in < min_prompt_len or n_out < 1:
            continue
        out.append(BenchRequest(prompt, n_in, n_out))
        if len(out) == num:
            break
    if len(out) < num:
        raise ValueError(f"{path} holds {len(out)} usable conversations, fewer than the {num} asked for")
    return out


def write_sharegpt(path: str | Path, requests: list[BenchRequest]) -> None:
    """Save a workload as ShareGPT JSON (the gpt turn is empty: pass a fixed `output_len` when
    loading it back), so other tools or engines can replay exactly the same prompts."""
    data = [
        {"id": str(i), "conversations": [{"from": "human", "value": r.prompt}, {"from": "gpt", "value": ""}]}
        for i, r in enumerate(requests)
    ]
    Path(path).write_text(json.dumps(data, ensure_ascii=False))


def workload_from_args(args: Any, tokenizer: Any) -> list[BenchRequest]:
    """The workload `rxf bench serve|offline` asked for (see the CLI's --dataset options)."""
    rng = random.Random(args.seed)
    if args.dataset == "random":
        return random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio, rng)
    if args.dataset == "shared-prefix":
        return shared_prefix_requests(
            tokenizer, args.num_groups, args.prompts_per_group, args.system_prompt_len, args.question_len,
            args.output_len, rng,
        )
    if args.dataset == "sharegpt-file":
        if not args.dataset_path:
            raise SystemExit("--dataset sharegpt-file needs --dataset-path FILE.json")
        return sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.sharegpt_output_len)
    raise SystemExit(f"unknown dataset {args.dataset!r}")
