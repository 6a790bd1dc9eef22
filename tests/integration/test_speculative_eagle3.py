"""EAGLE-3 heads (`speculative.method = "eagle3"`) in-process: the head's forward and every chain of
drafts against a plain-torch reimplementation of the documented forward, the radix tree's pair
keys, and the loading errors of malformed heads.

The reference (`Eagle3Reference`) reads the head's safetensors and transformers' hidden states of
the target, and recomputes the whole sequence each time (no KV cache): position p reads the token
after it and the target's states at p (fused by fc), or while drafting the head's own feature of
position p - 1. A drafter that fed the wrong position, token, state or KV would propose other tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rxf.core.config import load_config
from rxf.core.forward import ForwardMode
from rxf.core.ipc.messages import PreparedRequest
from rxf.core.registry import PluginRegistry
from rxf.core.runner.model_runner import ModelInput, ModelRunner
from rxf.core.sampling_params import SamplingParams
from rxf.core.scheduler.scheduler import Scheduler
from rxf.core.speculative.eagle import load_eagle3, target_aux_layers
from rxf.testing.checkpoints import make_tiny_checkpoint, make_tiny_eagle3_head
from rxf.testing.reference import HFReference, assert_logits_close

AUX_IDS = [1, 2, 3]  # inputs of target layers 1, 2, 3 (of 4): explicit, in vLLM's convention


class Eagle3Reference:
    """The head's documented forward in plain torch, over whole sequences."""

    def __init__(self, head_dir, target_dir, aux_ids: list[int]) -> None:
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


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("eagle-target"), seed=1, num_hidden_layers=4)


@pytest.fixture(scope="module")
def head(tmp_path_factory, target):
    return make_tiny_eagle3_head(tmp_path_factory.mktemp("eagle-head"), target, seed=3,
                                 eagle_aux_hidden_state_layer_ids=AUX_IDS)


@pytest.fixture(scope="module")
def reference(head, target):
    return Eagle3Reference(head, target, AUX_IDS)


def _config(target, head, **sections):
    base = {
        "model": {"path": str(target)}, "runtime": {"device": "cpu", "cpu_threads": 1},
        "attention": {"backend": "torch_native"}, "cache": {"max_total_tokens": 2048},
        "speculative": {"method": "eagle3", "draft_model_path": str(head), "num_draft_tokens": 4, "max_batch_size": 8},
        "scheduler": {"chunked_prefill_size": 8},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return load_config(base)


def _engine(target, head, **sections):
    config = _config(target, head, **sections)
    registry = PluginRegistry.load()
    runner = ModelRunner(config, registry, str(target), aux_hidden_layers=target_aux_layers(config, str(target)))
    return config, runner, load_eagle3(config, registry, runner)


@torch.inference_mode()
def test_head_forward_matches_the_reference(target, head, reference):
    """A prefill of the target gives its auxiliary states; the head's forward over them (every
    row's logits and features) equals the reference."""
    _, runner, drafter = _engine(target, head)
    tokens = [5, 17, 33, 48, 17, 33, 60, 7, 9, 200, 3]
    row, slots = runner.req_to_token_pool.alloc(), runner.token_to_kv_pool.alloc(len(tokens))
    _, aux = runner.forward_with_aux(ModelInput(ForwardMode.PREFILL, [row], tokens, [0], [len(tokens)], slots))
    want_aux, states = reference.target_states(tokens)
    torch.testing.assert_close(aux[:-1], want_aux, rtol=1e-4, atol=1e-4)
    n = len(tokens) - 1
    inp = ModelInput(ForwardMode.PREFILL, [row], tokens[1:], [0], [n], slots[:n], logits_start=[0], hidden=aux[:-1].clone())
    logits, features = drafter.runner.forward_with_aux(inp)
    want_logits, want_features = reference.head(states, tokens[1:])
    assert_logits_close(logits, want_logits)
    torch.testing.assert_close(features, want_features, rtol=1e-4, atol=1e-4)


def _request(rid, ids, max_new, **params):
    return PreparedRequest(rid, ids, SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0,
                                                               "ignore_eos": True, **params}))


def _drain(sched):
    out: dict[str, dict] = {}
    while sched.has_work:
        for o in sched.step():
            r = out.setdefault(o.rid, {"ids": []})
            r["ids"] += o.new_token_ids
            r["cached"] = o.cached_tokens
    return out


def test_every_draft_is_the_heads_greedy_chain(target, head, reference):
    """Batched prompts prefilled in chunks of 8, then a second pass from the radix cache and
    prompts that share a prefix but not the next token: each proposal equals the reference chain
    for the request's tokens at that moment (where the reference's top two logits are not tied),
    and the outputs are transformers' greedy ones."""
    config, runner, drafter = _engine(target, head)
    sched = Scheduler(config, runner, AutoTokenizer.from_pretrained(target), check_memory=True, draft=drafter)
    proposals = []
    propose = drafter.propose

    def recording(reqs, budgets):
        drafts = propose(reqs, budgets)
        proposals.extend((r.fill_ids, d) for r, d in zip(reqs, drafts, strict=True) if d)
        return drafts

    drafter.propose = recording
    prompts = [[5, 17, 33, 48, 17, 33, 60, 7, 9], list(range(40, 70)), [100, 101, 102, 103, 100, 101]]
    hf = HFReference(target)
    want = [hf.greedy(p, 12) for p in prompts]
    for attempt in ("first pass", "second pass"):
        for i, p in enumerate(prompts):
            sched.add_request(_request(f"{attempt}-{i}", p, 12))
        got = _drain(sched)
        assert [got[f"{attempt}-{i}"]["ids"] for i in range(3)] == want, attempt
    assert [got[f"second pass-{i}"]["cached"] for i in range(3)] == [len(p) - 1 for p in prompts]
    # The tree keys (token, next token): a prompt that leaves the cached sequence at position m
    # shares its first m - 1 positions only (the entry at m - 1 read the other next token).
    fork = prompts[1][:20] + [7, 8, 9]
    sched.add_request(_request("fork", fork, 6))
    got = _drain(sched)
    assert got["fork"]["cached"] == 19 and got["fork"]["ids"] == hf.greedy(fork, 6)
    assert len(proposals) > 20
    for tokens, drafts in proposals:
        ref, margins = reference.chain(tokens, len(drafts))
        for t, (ours, theirs, margin) in enumerate(zip(drafts, ref, margins, strict=True)):
            assert ours == theirs or margin < 1e-4, (tokens, t, drafts, ref)
            if ours != theirs:
                break  # the rest continues another token


def _corrupt(path, drop=(), replace=None, config=None):
    tensors = load_file(str(path / "model.safetensors"))
    for name in drop:
        del tensors[name]
    tensors.update(replace or {})
    save_file(tensors, str(path / "model.safetensors"))
    if config:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(cfg | config))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ({"drop": ["fc.weight"]}, "parameters the checkpoint did not fill: fc.weight"),
        ({"drop": ["d2t"]}, "no d2t tensor"),
        ({"replace": {"d2t": torch.zeros(7, dtype=torch.int64)}}, "d2t must be an integer tensor [128]"),
        ({"replace": {"d2t": torch.full((128,), 10_000)}}, "d2t maps draft ids outside the target vocabulary"),
        ({"replace": {"fc.weight": torch.zeros(64, 100)}}, "cannot load checkpoint tensor fc.weight"),
        ({"config": {"vocab_size": 256}}, "vocab_size 256 is not the target's 512"),
        ({"config": {"architectures": ["LlamaForCausalLM"]}}, "LlamaForCausalLM is not a draft head"),
        ({"config": {"num_hidden_layers": 2}}, "one decoder layer are served; this one has 2"),
        ({"config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}, "reads target layers [1, 2, 9]; the target has 4"),
    ],
    ids=["no-fc", "no-d2t", "d2t-shape", "d2t-range", "fc-shape", "vocab", "not-a-head", "layers", "aux-ids"],
)
def test_a_malformed_head_fails_to_load_naming_the_reason(tmp_path, target, damage, message):
    path = make_tiny_eagle3_head(tmp_path / "head", target, seed=3)
    _corrupt(path, **damage)
    with pytest.raises(ValueError, match="speculative.draft_model_path") as info:
        _engine(target, path)
    assert message in str(info.value)
