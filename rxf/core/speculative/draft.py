"""The draft-model proposer: a smaller model with the target's tokenizer, run ahead of it.

It has its own `ModelRunner` (weights, KV pool, attention backend, decode CUDA graphs that its
catch-up extends replay too) in the scheduler process. Per request a `DraftKV` holds a row of its
`req_to_token` and the slots of the tokens it computed. Each speculative step first extends the draft over the request's tokens it has
not seen (the whole prompt the first time, then the tokens the last step accepted), whose last
logits give the first draft, then decodes k - 1 more, greedily: a deterministic draft, so the
target's verification (`accept.py`) is exact. Each step's drafts stay on the device and feed the
next step there (`PendingTokens`); all of them reach the host in one copy at the end.

The draft's KV is checked against the request's tokens before each proposal, from the last
position known to agree: rejected drafts, tokens after a stop and a jump-forward's re-tokenized
token are dropped there and their slots freed, so no bookkeeping runs after verification. A draft
pool too full for a request's tokens gives it no drafts that step (its target KV is unaffected).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rxf.core.forward import ForwardMode
from rxf.core.speculative.chain import ChainStep, read_drafts

if TYPE_CHECKING:
    from rxf.core.config import EngineConfig
    from rxf.core.registry import PluginRegistry
    from rxf.core.runner.model_runner import ModelRunner, PendingTokens
    from rxf.core.scheduler.req import Req

logger = logging.getLogger(__name__)


@dataclass
class DraftKV:
    """One request's draft KV: `slots[p]` holds the draft's K/V of `tokens[p]`, p < len(tokens);
    `[0, confirmed)` is known to equal the request's tokens (and is never its newest token)."""

    row: int
    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    confirmed: int = 0


def _token(req: Req, p: int) -> int:
    prompt = req.origin_input_ids
    return prompt[p] if p < len(prompt) else req.output_ids[p - len(prompt)]


class DraftModel:
    pairs_tree_keys = False  # its KV lives in its own pool: the radix tree keys tokens as usual

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.pool = runner.token_to_kv_pool

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        """Up to budgets[i] greedy draft tokens for each request (all its tokens known on the host).
        A draft forward that fails costs the step its drafts only: the requests' draft KV is dropped."""
        # The draft's positions must fit its own context too.
        budgets = [min(b, self.runner.max_context_len + 1 - r.known_len) for r, b in zip(reqs, budgets, strict=True)]
        try:
            return self._propose(reqs, budgets)
        except Exception:
            logger.exception("the draft model failed; this step decodes without drafts")
            for req in reqs:
                self.release(req)
            return [[] for _ in reqs]

    def _propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        from rxf.core.runner.model_runner import PendingTokens

        live = [i for i, b in enumerate(budgets) if b > 0 and self._prepare(reqs[i], b)]
        if not live:
            return [[] for _ in reqs]

        # The tokens each draft has not computed yet (at least the newest), as one extend.
        news = [[_token(reqs[i], p) for p in range(len(reqs[i].draft_kv.tokens), reqs[i].known_len)] for i in live]
        ids = self._forward(ForwardMode.EXTEND, [reqs[i] for i in live], news)
        steps: list[ChainStep] = [(live, ids)]
        for step in range(1, max(budgets[i] for i in live)):
            prev = steps[-1][0]
            alive = [i for i in prev if budgets[i] > step]
            if not alive:
                break
            at = {i: j for j, i in enumerate(prev)}  # row j of the previous step's ids is request prev[j]'s
            pending = PendingTokens(list(range(len(alive))), [at[i] for i in alive], steps[-1][1])
            steps.append((alive, self._forward(ForwardMode.DECODE, [reqs[i] for i in alive], [[0]] * len(alive), pending)))
        drafts = read_drafts(steps, len(reqs))
        # The decode steps' input tokens (placeholders above) are the drafts before each one's last.
        for i in live:
            kv = reqs[i].draft_kv
            n = len(drafts[i]) - 1
            if n:
                kv.tokens[len(kv.tokens) - n :] = drafts[i][:-1]
        return drafts

    def _prepare(self, req: Req, budget: int) -> bool:
        """Drop the draft KV that no longer matches the request and take the slots this step needs
        (its unseen tokens + budget - 1 drafts); False (no drafts this step) if the pool lacks them."""
        kv = req.draft_kv
        if kv is None:
            row = self.runner.req_to_token_pool.alloc()
            if row is None:
                return False
            kv = req.draft_kv = DraftKV(row)
        end = min(len(kv.tokens), req.known_len - 1)  # the newest token is always recomputed
        keep = kv.confirmed
        while keep < end and kv.tokens[keep] == _token(req, keep):
            keep += 1
        self._truncate(kv, keep)
        kv.confirmed = keep
        need = req.known_len - keep + budget - 1
        if self.pool.available_size() < need:
            return False
        kv.slots.extend(self.pool.alloc(need).tolist())  # taken now, used by this step's forwards
        return True

    def _forward(
        self, mode: ForwardMode, reqs: list[Req], new: list[list[int]], pending: PendingTokens | None = None
    ) -> torch.Tensor:
        """Compute `new[j]` after request j's draft tokens (the ones `pending` names taken on the
        device); the argmax after each one's last, on the device."""
        from rxf.core.runner.model_runner import ModelInput

        prefix = [len(r.draft_kv.tokens) for r in reqs]
        slots = [r.draft_kv.slots[p : p + len(n)] for r, p, n in zip(reqs, prefix, new, strict=True)]
        inp = ModelInput(
            mode=mode,
            req_pool_indices=[r.draft_kv.row for r in reqs],
            input_ids=[t for n in new for t in n],
            prefix_lens=prefix,
            extend_lens=[len(n) for n in new],
            out_cache_loc=torch.tensor([s for ss in slots for s in ss], dtype=torch.int64),
            pending=pending,
        )
        for r, n in zip(reqs, new, strict=True):
            r.draft_kv.tokens += n
        return self.runner.forward(inp).argmax(dim=-1)

    def _truncate(self, kv: DraftKV, end: int) -> None:
        if len(kv.slots) > end:
            self.pool.free(torch.tensor(kv.slots[end:], dtype=torch.int64))
            del kv.slots[end:]
        del kv.tokens[end:]

    def release(self, req: Req) -> None:
        """Free the request's draft row and slots (finish, abort, retraction)."""
        kv, req.draft_kv = req.draft_kv, None
        if kv is not None:
            self._truncate(kv, 0)
            self.runner.req_to_token_pool.free(kv.row)


def load_draft_model(config: EngineConfig, registry: PluginRegistry, target: ModelRunner) -> DraftModel | None:
    """The draft model of `speculative.method = "draft"` (None for other methods): the target's
    settings with the draft's checkpoint, its own context length, and a KV pool of
    the target's slot count plus every running request's drafts."""
    spec = config.speculative
    if spec.method != "draft":
        return None
    from rxf.core.config import load_config
    from rxf.core.runner.model_runner import ModelRunner

    assert spec.draft_model_path is not None
    slots = target.max_total_tokens + config.scheduler.max_running_requests * spec.num_draft_tokens
    draft_config = load_config(
        config,
        **{
            "model.path": spec.draft_model_path, "model.tokenizer_path": None, "model.context_length": None,
            "cache.max_total_tokens": slots, "scheduler.overlap": False,
            "speculative.method": "none", "speculative.draft_model_path": None,

        },
    )
    runner = ModelRunner(draft_config, registry, spec.draft_model_path, catches_up=True)
    if runner.vocab_size > target.vocab_size:
        raise ValueError(
            f"speculative.draft_model_path: its vocabulary ({runner.vocab_size}) is larger than the target's "
            f"({target.vocab_size}); a draft model must share the target's tokenizer"
        )
    return DraftModel(runner)
