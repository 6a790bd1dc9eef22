"""Speculative decoding on the demo model (SmolLM2-135M-Instruct): n-gram drafts on an
input-grounded prompt give the same greedy tokens, finish reasons and logprobs as decoding without
them, with stops inside accepted spans, `n` > 1, a JSON schema (jump-forward on), a regex whose mask
applies at every drafted position, and streaming.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rxf import Runtime

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.toml"
PASSAGE = (
    "The lighthouse keeper climbed the stairs every evening at dusk. He lit the great lamp, wound the "
    "clockwork and wrote the weather in his log."
)
PROMPTS = [
    f"Repeat this passage exactly:\n{PASSAGE}\nRepeated:\n",
    "def area(width, height):\n    return width * height\n\n# The same function, renamed to rect_area:\n",
]
SCHEMA = json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string"}, "stairs": {"type": "integer"}, "lamp": {"type": "boolean"}},
    "required": ["name", "stairs", "lamp"],
})


def _runtime(method: str) -> Runtime:
    # Every request of the concurrent batch drafts (the default stops above 4 decoding requests).
    # float32: equality with speculation off is exact only where a verify extend and a decode step
    # round alike; bf16 (the demo's dtype) rounds their different reductions differently.
    overrides = {"runtime.cpu_threads": 1, "speculative.method": method, "speculative.max_batch_size": 8,
                 "model.dtype": "float32"}
    return Runtime.from_config(DEMO, **overrides)


@pytest.fixture(scope="module")
def outputs():
    """Every case, with speculation off and on, run concurrently (one batch, as a server sees them):
    (params, prompt index, n, options); then a stop-string case built from the plain output."""
    greedy = {"temperature": 0, "max_new_tokens": 24}
    cases = [
        ({**greedy}, 0, 1, {"return_logprob": True, "top_logprobs_num": 2}),
        ({**greedy}, 1, 1, {}),
        ({**greedy, "max_new_tokens": 13}, 0, 1, {}),  # the budget ends inside an accepted span
        ({**greedy, "json_schema": SCHEMA, "max_new_tokens": 32}, 0, 1, {}),
        ({**greedy}, 1, 2, {}),
        ({**greedy}, 1, 1, {"stream": True}),
        ({**greedy, "regex": "[A-Za-z ,.]+"}, 0, 1, {}),  # a mask at every drafted position
    ]
    results = {}
    for method in ("none", "ngram"):
        with _runtime(method) as rt, ThreadPoolExecutor(len(cases)) as pool:
            def run(case):
                params, p, n, opts = case
                out = rt.generate(PROMPTS[p], params, n=n, **opts)
                return list(out) if opts.get("stream") else out

            results[method] = list(pool.map(run, cases))
            if method == "none":  # stop strings inside the plain output's text
                words = results["none"][0]["text"].split()
                stops = [words[6], words[12] + " " + words[13]]
            results[method].append(rt.generate(PROMPTS[0], {**greedy, "stop": stops}))
    return results


def test_greedy_outputs_are_identical(outputs):
    off, on = outputs["none"], outputs["ngram"]
    for i in (0, 1, 2, 3, 6, 7):
        a, b = off[i], on[i]
        assert b["output_ids"] == a["output_ids"] and b["text"] == a["text"], f"case {i}"
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"], f"case {i}"
    assert on[7]["meta_info"]["finish_reason"]["type"] == "stop" and on[2]["meta_info"]["completion_tokens"] == 13
    # n = 2: both choices identical to the plain ones.
    assert [c["output_ids"] for c in on[4]] == [c["output_ids"] for c in off[4]]
    json.loads(on[3]["text"])  # the schema's instance
    # Accept length > 1 on the input-grounded prompt, with and without a regex.
    for meta in (on[0]["meta_info"], on[6]["meta_info"]):
        assert meta["spec_verify_ct"] < meta["completion_tokens"] - 1, meta
    assert "spec_verify_ct" not in off[0]["meta_info"]


def test_logprobs_of_accepted_tokens_match(outputs):
    a, b = outputs["none"][0]["meta_info"], outputs["ngram"][0]["meta_info"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert key in a
    for (lp_a, id_a), (lp_b, id_b) in zip(a["output_token_logprobs"], b["output_token_logprobs"], strict=True):
        assert id_a == id_b and lp_a == pytest.approx(lp_b, abs=1e-4)
    for top_a, top_b in zip(a["output_top_logprobs"], b["output_top_logprobs"], strict=True):
        assert [t for _, t in top_a] == [t for _, t in top_b]
        assert [lp for lp, _ in top_a] == pytest.approx([lp for lp, _ in top_b], abs=1e-4)


def test_streamed_chunks_add_up(outputs):
    off, on = outputs["none"][5], outputs["ngram"][5]
    assert "".join(c["text"] for c in on) == "".join(c["text"] for c in off)
    assert len(on) < len(off)  # accepted drafts arrive together
