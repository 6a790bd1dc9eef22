"""EAGLE-3 speculation: a one-layer draft head that reads the target's hidden states (chain drafts;
trees with `speculative.tree_topk` > 1 in `eagle_tree.py`).

The head (`rxf/plugins/models/llama_eagle3.py` documents its checkpoint and forward) runs in the
scheduler process on a `ModelRunner(draft_of=target)`: its own weights, attention backend and a
KV pool with the target's slot numbers, read through the target's req_to_token rows. So the
head's K/V of a position lives in the same slot as the target's, and whatever holds the slot (a
request, the radix cache) holds both.

The head's entry at position p is computed from the target's states at p and the token x_{p+1}
after it, so it exists only once x_{p+1} is known:

- Invariant: after every step's postprocessing, each slot holding a target position p whose next
  token is known also holds the head's entry for p (and the radix tree holds only such positions:
  its keys pair each token with the next one, `KVManager(pair_keys=True)`, so a cached slot is
  shared only by sequences that agree on the next token too). `absorb` keeps it: after each
  target step it computes the positions that step computed whose next token is now known (a
  prompt chunk's, the accepted tokens of a verify), from the step's auxiliary hidden states,
  including the positions of requests that finished in that step (their slots may enter the tree).
- The absorb's last row of a request that is caught up (its head covers [0, known_len - 1)) gives
  the first draft token (greedy over the draft vocabulary, mapped to a target id) and the feature
  the next position reads: its `EagleState`.
- `propose` continues from it for budget - 1 more greedy steps, each a DECODE of the head fed its
  own previous feature and token (on the device; the drafts reach the host in one copy). Those
  steps' K/V go into slots lent by the free list for the call: the verify forward rewrites the
  row entries of those positions with its own slots, and the absorb after it recomputes the
  accepted ones from the target's states, as EAGLE does.

Greedy drafts are deterministic, so the target's verification (`accept.py`) stays exact under
sampling too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig

from rxf.core.forward import ForwardMode
from rxf.core.speculative.chain import ChainStep, read_drafts

if TYPE_CHECKING:
    from rxf.core.config import EngineConfig
    from rxf.core.registry import PluginRegistry
    from rxf.core.runner.model_runner import ModelRunner
    from rxf.core.scheduler.req import Req

logger = logging.getLogger(__name__)


def aux_layer_ids(head_config: Any, target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs (transformers' `hidden_states[i]`; 0 is the embeddings) the
    head reads, low to high. A top-level `eagle_aux_hidden_state_layer_ids` (vLLM's speculators
    format) names those inputs; `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang's
    SpecForge) names layer outputs, the next layers' inputs. Without either: the published default,
    the inputs of layers 2, L // 2 and L - 3."""
    ids = getattr(head_config, "eagle_aux_hidden_state_layer_ids", None)
    if ids:
        return tuple(int(i) for i in ids)
    ids = (getattr(head_config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) + 1 for i in ids)
    return (2, target_layers // 2, target_layers - 3)


def target_aux_layers(config: EngineConfig, model_path: str) -> tuple[int, ...]:
    """What the target must capture for `speculative.method = "eagle3"` (() otherwise)."""
    spec = config.speculative
    if spec.method != "eagle3":
        return ()
    assert spec.draft_model_path is not None
    trust = config.model.trust_remote_code
    head = AutoConfig.from_pretrained(spec.draft_model_path, trust_remote_code=trust)
    target = AutoConfig.from_pretrained(model_path, trust_remote_code=trust).get_text_config()
    layers = target.num_hidden_layers
    ids = aux_layer_ids(head, layers)
    if len(ids) != 3 or any(not 0 <= i < layers for i in ids):
        raise ValueError(
            f"speculative.draft_model_path {spec.draft_model_path}: it reads target layers {list(ids)}; the target "
            f"has {layers} (an EAGLE-3 head reads the inputs of 3 of them)"
        )
    return ids


@dataclass
class EagleState:
    """Where a request's next draft starts: the head covers positions [0, length) and `token` (a
    target id) and `feature` (its state for position `length`) continue it; valid while the
    request's known tokens are length + 1."""

    token: torch.Tensor  # device int64 []
    feature: torch.Tensor  # device [hidden]
    length: int
    # Trees (tree_topk > 1): the first level of the tree, the head's top tokens (target ids) and
    # their log-probabilities over the draft vocabulary, likelier first.
    top_tokens: torch.Tensor | None = None  # device int64 [tree_topk]
    top_logprobs: torch.Tensor | None = None  # device float32 [tree_topk]


@dataclass
class AbsorbItem:
    """Positions [start, start + len(tokens)) of one request that the head computes from the
    target's states: `tokens` are the tokens after them, `slots` their (target's) slots,
    `state_rows` their rows in the step's auxiliary hidden states, `row_write` the row entries
    before `start` that the device row may lack (`KVManager.stale_entries`). `req` is None for a
    request that finished: nothing is kept for it."""

    req: Req | None
    row: int
    start: int
    tokens: list[int]
    slots: torch.Tensor
    state_rows: torch.Tensor
    row_write: tuple[int, torch.Tensor] | None


class Eagle3Drafter:
    # The head's entry at a position depends on the next token too: the radix tree pairs them.
    pairs_tree_keys = True

    def __init__(self, runner: ModelRunner, target: ModelRunner, tree_topk: int = 1) -> None:
        self.runner = runner
        self.head = runner.model
        self.free_list = target.token_to_kv_pool  # the slot numbers the head's pool shares
        self.tree_topk = tree_topk

    # ---- after each target step ----
    def absorb(self, items: list[AbsorbItem], states: torch.Tensor) -> None:
        """Compute the head's entries for `items` from the target's auxiliary hidden states
        `states` (one row per token of the step). A failure costs later drafts only: the
        requests' states are dropped (their drafts come back after their next absorb)."""
        items = [it for it in items if it.tokens]
        if not items:
            return
        try:
            self._absorb(items, states)
        except Exception:
            logger.exception("the EAGLE-3 head failed; its requests draft nothing until their next step")
            for it in items:
                if it.req is not None:
                    it.req.eagle = None

    def _absorb(self, items: list[AbsorbItem], states: torch.Tensor) -> None:
        from rxf.core.runner.model_runner import ModelInput

        rows = torch.cat([it.state_rows for it in items]).to(states.device, non_blocking=True)
        writes = [it.row_write for it in items]
        inp = ModelInput(
            mode=ForwardMode.EXTEND if any(it.start for it in items) else ForwardMode.PREFILL,
            req_pool_indices=[it.row for it in items],
            input_ids=[t for it in items for t in it.tokens],
            prefix_lens=[it.start for it in items],
            extend_lens=[len(it.tokens) for it in items],
            out_cache_loc=torch.cat([it.slots for it in items]),
            row_writes=writes if any(w is not None for w in writes) else None,
            hidden=states.index_select(0, rows),
        )
        logits, features = self.runner.forward_with_aux(inp)
        assert features is not None
        tokens = self.head.to_target_ids(logits.argmax(dim=-1))
        top = None
        if self.tree_topk > 1:
            top_logprobs, top_ids = logits.log_softmax(dim=-1).topk(self.tree_topk, dim=-1)
            top = (self.head.to_target_ids(top_ids), top_logprobs)
        for j, it in enumerate(items):
            if it.req is None:
                continue
            end = it.start + len(it.tokens)
            caught_up = end == it.req.known_len - 1
            it.req.eagle = None
            if caught_up:
                it.req.eagle = EagleState(tokens[j], features[j], end, *((top[0][j], top[1][j]) if top else ()))

    # ---- drafting ----
    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        """Up to budgets[i] greedy draft tokens for each request (none for one whose state is not
        current). A failing head forward costs the step its drafts only."""
        try:
            return self._propose(reqs, budgets)
        except Exception:
            logger.exception("the EAGLE-3 head failed; this step decodes without drafts")
            return [[] for _ in reqs]

    def _propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        from rxf.core.runner.model_runner import ModelInput, PendingTokens

        live = [i for i, (r, b) in enumerate(zip(reqs, budgets, strict=True)) if b > 0 and _current(r)]
        if not live:
            return [[] for _ in reqs]
        # Steps after the first write the head's K/V of positions length .. length + budget - 2.
        lent = self.free_list.alloc(sum(budgets[i] - 1 for i in live))
        if lent is None:  # too few free slots: only the first draft, which needs none
            budgets = [min(b, 1) for b in budgets]
            lent = torch.empty(0, dtype=torch.int64)
        try:
            own = dict(zip(live, lent.split([budgets[i] - 1 for i in live]), strict=True))
            tokens = torch.stack([reqs[i].eagle.token for i in live])
            features = torch.stack([reqs[i].eagle.feature for i in live])
            steps: list[ChainStep] = [(live, tokens)]
            for step in range(1, max(budgets[i] for i in live)):
                prev = steps[-1][0]
                alive = [i for i in prev if budgets[i] > step]
                if not alive:
                    break
                # Row j of the previous step's outputs belongs to request prev[j].
                at = {i: j for j, i in enumerate(prev)}
                picked = [at[i] for i in alive]
                positions = [reqs[i].eagle.length + step - 1 for i in alive]
                inp = ModelInput(
                    mode=ForwardMode.DECODE,
                    req_pool_indices=[reqs[i].kv.row for i in alive],
                    input_ids=[0] * len(alive),  # the previous drafts, patched in on the device
                    prefix_lens=positions,
                    extend_lens=[1] * len(alive),
                    out_cache_loc=torch.stack([own[i][step - 1] for i in alive]),
                    pending=PendingTokens(list(range(len(alive))), picked, tokens),
                    hidden=features.index_select(0, torch.tensor(picked).to(features.device, non_blocking=True)),
                )
                logits, features = self.runner.forward_with_aux(inp)
                tokens = self.head.to_target_ids(logits.argmax(dim=-1))
                steps.append((alive, tokens))
        finally:
            self.free_list.free(lent)
        return read_drafts(steps, len(reqs))

    def propose_trees(
        self, reqs: list[Req], budgets: list[int], topk: int, depth: int
    ) -> tuple[list[list[int]], list[list[int] | None]]:
        """Up to budgets[i] draft tokens for each request as a tree (`eagle_tree.py`) and their
        parents; a failing head forward costs the step its drafts only."""
        from rxf.core.speculative.eagle_tree import draft_trees

        try:
            return draft_trees(self, reqs, budgets, topk, depth)
        except Exception:
            logger.exception("the EAGLE-3 head failed; this step decodes without drafts")
            return [[] for _ in reqs], [None] * len(reqs)

    def release(self, req: Req) -> None:
        """The request gives up its KV (finish, abort, retraction): its state goes too."""
        req.eagle = None


def _current(req: Req) -> bool:
    return req.eagle is not None and req.eagle.length == req.known_len - 1 and req.kv is not None


def load_eagle3(config: EngineConfig, registry: PluginRegistry, target: ModelRunner) -> Eagle3Drafter | None:
    """The drafter of `speculative.method = "eagle3"` (None for other methods): the head from
    `draft_model_path` in the target's dtype and context, eager, embedding the tokens with its own
    embedding or the target's. Every problem with the head is a ValueError naming the path."""
    spec = config.speculative
    if spec.method != "eagle3":
        return None
    from rxf.core.config import load_config
    from rxf.core.runner import distributed
    from rxf.core.runner.model_runner import ModelRunner

    path = spec.draft_model_path
    assert path is not None
    if distributed.tp_size() > 1:
        raise ValueError("speculative.method 'eagle3' runs with parallel.tp_size = 1 only")
    if target.pooling is not None:
        raise ValueError("speculative.method 'eagle3' needs a generative model (model.task = 'generate')")
    head_config = load_config(
        config,
        **{
            "model.path": path, "model.tokenizer_path": None, "model.context_length": target.max_context_len,
            "model.dtype": str(target.dtype).removeprefix("torch."), "model.quantization": None,
            "scheduler.overlap": False, "speculative.method": "none", "speculative.draft_model_path": None,
            "speculative.tree_topk": 1,  # (its forwards use the target's scratch rows)
            # Its decode steps draft for at most max_batch_size requests, tree_topk rows each.
            "cuda_graph.max_bs": min(config.cuda_graph.max_bs, spec.max_batch_size * spec.tree_topk),
        },
    )
    try:
        runner = ModelRunner(head_config, registry, path, draft_of=target)
        head = runner.model
        target_hidden = target.hf_config.get_text_config().hidden_size
        if head.target_hidden_size != target_hidden:
            raise ValueError(f"it reads target states of {head.target_hidden_size}, the target's are {target_hidden}")
        own_embedding = head.embed_tokens is not None
        if not own_embedding:
            embedding = getattr(target.model, "input_embeddings", None)
            if embedding is None:
                raise ValueError(f"it has no embedding and {type(target.model).__name__} shares none")
            head.share_embedding(embedding())
        runner.capture_cuda_graphs()
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative.draft_model_path {path}: {e}") from e
    logger.info(
        "EAGLE-3 head %s: draft vocabulary %d, reads target layers %s, %s embedding",
        path, head.draft_vocab_size, list(target.aux_hidden_layers), "own" if own_embedding else "the target's",
    )
    return Eagle3Drafter(runner, target, spec.tree_topk)
