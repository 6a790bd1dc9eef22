"""Speculative decoding: draft tokens proposed on the host, verified in one forward of the model.

A speculative step gives each request its newest token followed by up to k draft tokens, as an
extend of k + 1 tokens over its cached prefix (causal attention, as every backend computes it; on
the GPU replayed from the decode graphs as one decode row per token, `ModelRunner._extend_rows`). The
runner samples every one of those positions with the request's own sampler (penalties, banned ids
and grammar mask of that position) and the scheduler accepts the drafts while they equal what the
model sampled (`accept.py`). Proposers: `ngram.py` (prompt lookup), `draft.py` (a smaller model)
and `eagle.py` (an EAGLE-3 head); the last two draft chains on the device (`chain.py`).
"""
