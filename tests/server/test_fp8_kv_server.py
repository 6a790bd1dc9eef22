"""A server with an FP8 KV cache: the startup log and /get_server_info show the KV dtype and the
token capacity, and it answers the official openai client."""

from __future__ import annotations

from openai import OpenAI


def test_fp8_kv_server_shows_dtype_and_capacity(server_factory) -> None:
    srv = server_factory({"cache.kv_dtype": "fp8_e4m3", "cache.max_total_tokens": 3000})
    with srv.client() as http:
        info = http.get("/get_server_info").json()
    assert info["engine"]["kv_dtype"] == "float8_e4m3fn" and info["engine"]["max_total_tokens"] == 3000
    assert info["config"]["cache"]["kv_dtype"] == "fp8_e4m3"
    assert "KV pool: 3000 tokens of float8_e4m3fn" in srv.log()
    out = OpenAI(base_url=srv.base_url, api_key="unused").completions.create(
        model=info["served_model_name"], prompt="The capital of France is", max_tokens=8, temperature=0,
    )
    assert out.usage.completion_tokens == 8 and out.choices[0].text
