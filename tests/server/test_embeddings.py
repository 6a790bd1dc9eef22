"""/v1/embeddings through the official `openai` client against a server of a tiny Qwen3 embedding
model shaped as Qwen3-Embedding (last-token pooling, a Normalize module; Matryoshka sizes 16 and
32 in its config), checked against transformers' pooled hidden states; and the 400s of an
embedding model asked to generate (a generative model asked for embeddings: test_openai_api.py)."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from rxf.testing.checkpoints import add_sentence_transformers_config, make_tiny_checkpoint
from rxf.testing.reference import HFReference

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Serving engines batch many requests.", "你好，世界"]
IDS = [[(5 * i + 11 * j) % 500 + 5 for j in range(n)] for i, n in enumerate((30, 9))]


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3-embedding"), "Qwen3ForCausalLM", seed=7, head_dim=32,
        matryoshka_dimensions=[16, 32],
    )
    return add_sentence_transformers_config(path, "lasttoken", normalize=True), HFReference(path)


@pytest.fixture(scope="module")
def embed_server(embed_model, module_server_factory):
    return module_server_factory(
        {"model.path": str(embed_model[0]), "model.task": "embed", "scheduler.chunked_prefill_size": 8}
    )


@pytest.fixture(scope="module")
def embed_client(embed_server):
    return openai.OpenAI(base_url=embed_server.base_url, api_key="unused", max_retries=0, timeout=120)


def _close(ours, ref: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float32), ref, rtol=1e-4, atol=1e-5)


def test_batch_of_texts_matches_transformers(embed_client, embed_model) -> None:
    path, ref = embed_model
    tokenizer = AutoTokenizer.from_pretrained(path)
    resp = embed_client.embeddings.create(model=str(path), input=TEXTS, encoding_format="float")
    assert [d.index for d in resp.data] == [0, 1, 2] and resp.model == str(path)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    for prompt, item in zip(prompts, resp.data, strict=True):
        _close(item.embedding, ref.embedding(prompt, "last", normalize=True))
    n = sum(map(len, prompts))
    assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (n, n)


@pytest.mark.parametrize("batched", [False, True])
def test_token_ids_base64(embed_client, embed_model, batched) -> None:
    """The SDK asks for base64 unless told otherwise, and decodes it as float32. The batch repeats
    the single prompt, which last-token pooling then finds in the prefix cache: the same vector."""
    path, ref = embed_model
    resp = embed_client.embeddings.create(model=str(path), input=IDS if batched else IDS[0])
    assert len(resp.data) == (2 if batched else 1)
    for prompt, item in zip(IDS, resp.data, strict=False):
        _close(item.embedding, ref.embedding(prompt, "last", normalize=True))


def test_base64_is_the_float32_vector(embed_server, embed_model) -> None:
    path = str(embed_model[0])
    with embed_server.client() as http:
        answers = [
            http.post("/v1/embeddings", json={"model": path, "input": TEXTS[0], "encoding_format": fmt}).json()
            for fmt in ("float", "base64")
        ]
    floats, packed = (a["data"][0]["embedding"] for a in answers)
    assert isinstance(packed, str)
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(packed), "<f4"), np.array(floats, dtype="<f4"))


def test_dimensions_truncate_then_renormalise_and_normalize_false(embed_client, embed_model) -> None:
    path, ref = embed_model
    resp = embed_client.embeddings.create(model=str(path), input=IDS[0], dimensions=16, encoding_format="float")
    assert len(resp.data[0].embedding) == 16
    _close(resp.data[0].embedding, ref.embedding(IDS[0], "last", normalize=True, dimensions=16))
    raw = embed_client.embeddings.create(
        model=str(path), input=IDS[0], encoding_format="float", extra_body={"normalize": False}
    )
    _close(raw.data[0].embedding, ref.embedding(IDS[0], "last", normalize=False))
    with pytest.raises(openai.BadRequestError) as err:
        embed_client.embeddings.create(model=str(path), input=IDS[0], dimensions=8)
    assert err.value.body["param"] == "dimensions" and "[16, 32]" in err.value.body["message"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [({"input": []}, "input", "empty"), ({"input": [[]]}, "input", "empty"), ({"input": [1, 10**6]}, "input", "[0, 512)"),
     ({"input": "x", "encoding_format": "int8"}, "encoding_format", "float"),
     ({"input": ["x"] * 2048}, "input", "at most 1088")],  # more than the server holds (64 running + 1024 queued)
)
def test_bad_input_is_a_400(embed_server, embed_model, body, param, words) -> None:
    with embed_server.client() as http:
        r = http.post("/v1/embeddings", json={"model": str(embed_model[0]), **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_embedding_model_refuses_generation(embed_client, embed_model) -> None:
    path = str(embed_model[0])
    with pytest.raises(openai.BadRequestError, match="serves embeddings"):
        embed_client.chat.completions.create(model=path, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="/v1/embeddings"):
        embed_client.completions.create(model=path, prompt="Hi", max_tokens=4)



def test_health_generate_and_model_info(embed_server) -> None:
    with embed_server.client() as http:
        assert http.get("/health_generate").json()["status"] == "ok"
        info = http.get("/get_model_info").json()
    assert info["is_generation"] is False
    assert info["pooling"] == {"method": "last", "normalize": True, "hidden_size": 64, "matryoshka_dimensions": [16, 32]}
