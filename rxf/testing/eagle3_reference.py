"""A plain-torch reimplementation of the EAGLE-3 head's documented forward, for tests: it reads the
head's safetensors and transformers' hidden states of the target, and recomputes whole sequences
(no KV cache): position p reads the token after it and the target's states at p (fused by fc), or
while drafting the head's own feature of position p - 1 (`rxf/plugins/models/llama_eagle3.py`).

    ref = Eagle3Reference(head_dir, target_dir, aux_ids=[1, 2, 3])
    ref.chain(tokens, 4)                       # the head's 4 greedy drafts after `tokens`, and margins
    sched, proposals = recording_scheduler(config)   # a Scheduler whose proposals are recorded
    check_proposals(ref, proposals)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

if TYPE_CHECKING:
    from rxf.core.config import EngineConfig
    from rxf.core.runner.model_runner import ModelRunner
    from rxf.core.scheduler.scheduler import Scheduler
    from rxf.core.speculative.eagle import Eagle3Drafter


class Eagle3Reference:
    """The head's documented forward in plain torch, over whole sequences."""

    def __init__(self, head_dir: str | Path, target_dir: str | Path, aux_ids: list[int]) -> None:
        head_dir = Path(head_dir)
        self.w = load_file(str(head_dir / "model.safetensors"))
        self.cfg = json.loads((head_dir / "config.json").read_text())
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.aux_ids = aux_ids
        self.draft_to_target = torch.arange(self.w["d2t"].numel()) + self.w["d2t"]

    def _norm(self, x, name):
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"]))

    def _attention(self, x):
        heads, kv = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        n, hd = x.shape[0], self.cfg["hidden_size"] // heads
        q = (x @ self.w["midlayer.self_attn.q_proj.weight"].T).view(n, heads, hd)
        k = (x @ self.w["midlayer.self_attn.k_proj.weight"].T).view(n, kv, hd)
        v = (x @ self.w["midlayer.self_attn.v_proj.weight"].T).view(n, kv, hd)
        theta = self.cfg.get("rope_theta") or self.cfg["rope_parameters"]["rope_theta"]
        inv = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos().float()[:, None], torch.cat([ang, ang], -1).sin().float()[:, None]

        def rot(t):
            a, b = t[..., : hd // 2], t[..., hd // 2 :]
            return t * cos + torch.cat([-b, a], -1) * sin

        q, k = rot(q), rot(k)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * hd)
        return out @ self.w["midlayer.self_attn.o_proj.weight"].T

    def head(self, states, next_tokens):
        """Logits over the draft vocabulary and features at every position, for fused states
        [n, hidden] and the tokens after each position."""
        embeds = self.target.model.embed_tokens.weight[torch.tensor(next_tokens)]
        if "embed_tokens.weight" in self.w:
            embeds = self.w["embed_tokens.weight"][torch.tensor(next_tokens)]
        x = torch.cat([self._norm(embeds, "midlayer.input_layernorm.weight"),
                       self._norm(states, "midlayer.hidden_norm.weight")], -1)
        residual = states + self._attention(x)
        h = self._norm(residual, "midlayer.post_attention_layernorm.weight")
        gate, up = h @ self.w["midlayer.mlp.gate_proj.weight"].T, h @ self.w["midlayer.mlp.up_proj.weight"].T
        feature = residual + (torch.nn.functional.silu(gate) * up) @ self.w["midlayer.mlp.down_proj.weight"].T
        return self._norm(feature, "norm.weight") @ self.w["lm_head.weight"].T, feature

    @torch.inference_mode()
    def target_states(self, tokens):
        """fc applied to the target's states at every position but the last."""
        hs = self.target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i][0] for i in self.aux_ids], -1)[:-1]
        return aux, aux @ self.w["fc.weight"].T

    @torch.inference_mode()
    def chain(self, tokens, k):
        """The head's k greedy drafts after `tokens`, with the top-2 margin of each."""
        _, states = self.target_states(tokens)
        after = list(tokens[1:])
        drafts, margins = [], []
        for _ in range(k):
            logits, features = self.head(states, after)
            top = logits[-1].topk(2).values
            margins.append(float(top[0] - top[1]))
            drafts.append(int(self.draft_to_target[logits[-1].argmax()]))
            states, after = torch.cat([states, features[-1:]]), after + [drafts[-1]]
        return drafts, margins


    @torch.inference_mode()
    def logits_after(self, tokens, path):
        """The head's draft-vocabulary logits after `tokens` and then the drafts `path` (each fed
        its predecessor's feature, as drafting does)."""
        _, states = self.target_states(tokens)
        after = list(tokens[1:])
        for token in path:
            _, features = self.head(states, after)
            states, after = torch.cat([states, features[-1:]]), after + [token]
        return self.head(states, after)[0][-1]


def check_tree_proposals(reference: Eagle3Reference, trees: list[tuple[list[int], list[int], list[int]]], topk: int,
                         tie: float = 1e-4) -> None:
    """In each proposed tree (the tokens it followed, its drafts, their parents) every node's
    children are among the reference's `topk` likeliest tokens after that node's path (a child
    within `tie` of the k-th logit counts as one of them)."""
    from rxf.core.draft_tree import draft_path

    to_draft = {int(t): d for d, t in enumerate(reference.draft_to_target.tolist())}
    for tokens, drafts, parents in trees:
        assert all(-1 <= p < j for j, p in enumerate(parents)), parents
        for node in range(-1, len(drafts)):
            children = [drafts[j] for j, p in enumerate(parents) if p == node]
            if not children:
                continue
            logits = reference.logits_after(tokens, draft_path(drafts, parents, node))
            kth = logits.topk(topk).values[-1]
            for child in children:
                assert float(logits[to_draft[child]]) >= float(kth) - tie, (tokens, node, child, drafts, parents)


def eagle3_engine(config: EngineConfig) -> tuple[ModelRunner, Eagle3Drafter]:
    """The target's runner (capturing what the head reads) and the drafter, as the scheduler
    process builds them."""
    from rxf.core.registry import PluginRegistry
    from rxf.core.runner.model_runner import ModelRunner
    from rxf.core.speculative.eagle import load_eagle3, target_aux_layers

    registry = PluginRegistry.load()
    path = config.model.path
    runner = ModelRunner(config, registry, path, aux_hidden_layers=target_aux_layers(config, path))
    drafter = load_eagle3(config, registry, runner)
    assert drafter is not None, "speculative.method must be 'eagle3'"
    return runner, drafter


def recording_scheduler(config: EngineConfig) -> tuple[Scheduler, list[tuple[list[int], list[int]]]]:
    """A Scheduler over `eagle3_engine(config)` (the KV ledger checked every step), and the list
    that receives each proposal as (the request's tokens then, its drafts), a tree's as (tokens,
    drafts, parents)."""
    from transformers import AutoTokenizer

    from rxf.core.scheduler.scheduler import Scheduler

    runner, drafter = eagle3_engine(config)
    sched = Scheduler(config, runner, AutoTokenizer.from_pretrained(config.model.path), check_memory=True, draft=drafter)
    proposals: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def recording(reqs, budgets):
        drafts = propose(reqs, budgets)
        proposals.extend((r.fill_ids, d) for r, d in zip(reqs, drafts, strict=True) if d)
        return drafts

    def recording_trees(reqs, budgets, topk, depth):
        drafts, parents = propose_trees(reqs, budgets, topk, depth)
        proposals.extend((r.fill_ids, d, p) for r, d, p in zip(reqs, drafts, parents, strict=True) if d)
        return drafts, parents

    propose_trees = drafter.propose_trees
    drafter.propose = recording  # type: ignore[method-assign]
    drafter.propose_trees = recording_trees  # type: ignore[method-assign]
    return sched, proposals


def check_proposals(reference: Eagle3Reference, proposals: list[tuple[list[int], list[int]]], tie: float = 1e-4) -> None:
    """Each proposal equals the reference chain for the tokens it followed, up to its first
    position where the reference's top two logits are within `tie` (either choice is then right)."""
    for tokens, drafts in proposals:
        ref, margins = reference.chain(tokens, len(drafts))
        for t, (ours, theirs, margin) in enumerate(zip(drafts, ref, margins, strict=True)):
            assert ours == theirs or margin < tie, (tokens, t, drafts, ref)
            if ours != theirs:
                break  # the rest continues another token
