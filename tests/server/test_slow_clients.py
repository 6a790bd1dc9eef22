"""Slow and greedy clients against the real server (`GuardedH11Protocol`), with short timeouts: a
request's headers or body trickled in is answered 408 and closed after `header_timeout_s` /
`body_timeout_s` while /health stays fast; connections beyond `max_connections` get 503 +
Retry-After; a client that reads nothing of its stream is cut after `send_timeout_s` and its
request aborted; streams and kept-alive connections outlive the read timeouts."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import psutil
import pytest

from rxf.testing.health_probe import HealthProbe

HEADER_S, BODY_S, SEND_S, MAX_CONNECTIONS = 1.0, 2.0, 2.0, 48
SLACK_S = 1.5  # timers fire on the server's event loop, which a loaded CI machine may run late


@pytest.fixture(scope="module")
def server(module_server_factory, long_context_model_dir):
    return module_server_factory({
        "model.path": str(long_context_model_dir), "cache.max_total_tokens": 65536,
        "server.header_timeout_s": HEADER_S, "server.body_timeout_s": BODY_S, "server.send_timeout_s": SEND_S,
        "server.max_connections": MAX_CONNECTIONS,
    })


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def _connect(server, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting, so the window the server sees is small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", _port(server)))
    sock.settimeout(10)
    return sock


def _read_to_end(sock: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except OSError:  # reset after the answer
        pass
    return out


def _trickle(server, head: bytes, piece: bytes, interval_s: float, out: list) -> None:
    """Send `head`, then `piece` every `interval_s` until the server answers; appends (seconds from
    the connection to the answer, the answer)."""
    sock = _connect(server)
    start = time.monotonic()
    sock.sendall(head)
    for _ in range(int(10 / interval_s)):
        readable, _, _ = select.select([sock], [], [], interval_s)
        if readable:
            break
        try:
            sock.sendall(piece)
        except OSError:
            break
    answered = time.monotonic() - start
    out.append((answered, _read_to_end(sock)))
    sock.close()


def test_trickled_headers_and_bodies_get_408_in_time_while_health_stays_fast(server):
    headers: list = []
    bodies: list = []
    body_head = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{")
    threads = [threading.Thread(target=_trickle, args=(server, b"POST /generate HTTP/1.1\r\n", b"X-Slow: 1\r\n", 0.2, headers))
               for _ in range(20)]
    threads += [threading.Thread(target=_trickle, args=(server, body_head, b" ", 0.2, bodies)) for _ in range(10)]
    with HealthProbe(server.url) as probe:
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
    assert len(headers) == 20 and len(bodies) == 10
    for (answered, answer), limit in [(h, HEADER_S) for h in headers] + [(b, BODY_S) for b in bodies]:
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer[:200]
        assert b"connection: close" in answer.lower()
        assert limit - 0.05 <= answered < limit + SLACK_S, (answered, limit)
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_timeout" and "timeout_s" in error["message"], error
    print(f"\n30 trickling clients cut at {min(a for a, _ in headers):.2f}-{max(a for a, _ in headers):.2f} s "
          f"(headers), {min(a for a, _ in bodies):.2f}-{max(a for a, _ in bodies):.2f} s (bodies); "
          f"/health max {probe.max_latency_s() * 1000:.1f} ms over {len(probe.probes)} probes")
    assert all(p.status == 200 for p in probe.probes)
    assert probe.max_latency_s() < 0.1


def test_connections_beyond_the_cap_get_503_with_retry_after(server):
    held = [_connect(server) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = _connect(server)
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = _read_to_end(extra)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer[:300]
        assert b"retry-after: 1" in head.lower() and b"connection: close" in head.lower()
        assert f"{MAX_CONNECTIONS} connections" in json.loads(body)["error"]["message"]
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5  # the server notices the closes at once; a new client is served
    while httpx.get(f"{server.url}/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_kept_alive_connections_and_long_streams_outlive_the_read_timeouts(server):
    with server.client() as http:
        assert http.get("/health").status_code == 200
        time.sleep(HEADER_S + 0.5)  # idle on the kept-alive connection: the keep-alive timeout (5 s) applies
        assert http.get("/health").status_code == 200
        # A stream read slowly for longer than both read timeouts ends properly.
        body = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
        start, events = time.monotonic(), []
        with http.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not events:  # after the first event, a pause past both read timeouts; the
                        time.sleep(HEADER_S + BODY_S + 0.5)  # server may pack several tokens per event
                    events.append(line)
        assert time.monotonic() - start > HEADER_S + BODY_S
        assert events[-1] == "data: [DONE]" and len(json.loads(events[-2][6:])["output_ids"]) == 40


def _stats(server) -> dict:
    return httpx.get(f"{server.url}/get_server_info").json()["stats"]


def test_a_client_that_reads_nothing_is_cut_and_its_request_aborted(server):
    """Cumulative native chunks with 20 top logprobs each grow fast, so the kernel's buffers and the
    transport's fill within a second; then nothing moves for `send_timeout_s`."""
    main = psutil.Process(server.proc.pid)
    rss_before = main.memory_info().rss
    body = json.dumps({"text": "x", "stream": True, "return_logprob": True, "top_logprobs_num": 20,
                       "sampling_params": {"max_new_tokens": 15000, "ignore_eos": True}}).encode()
    sock = _connect(server, rcvbuf=4096)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    start = time.monotonic()
    while _stats(server)["in_flight"] == 0:  # it starts
        assert time.monotonic() - start < 10
        time.sleep(0.05)
    rss_peak = rss_before
    while (stats := _stats(server))["in_flight"]:  # then it is aborted, without a byte read
        rss_peak = max(rss_peak, main.memory_info().rss)
        assert time.monotonic() - start < 30, "the stalled reader was never cut"
        time.sleep(0.1)
    cut_after = time.monotonic() - start
    deadline = time.monotonic() + 10
    while stats["num_running"] or stats["free_slots"] + stats["tree_slots"] != stats["total_slots"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
        stats = _stats(server)
    sock.settimeout(5)
    _read_to_end(sock)  # what the buffers held, then the reset: the connection is gone
    sock.close()
    growth = (rss_peak - rss_before) / 2**20
    print(f"\nstalled reader cut {cut_after:.1f} s after it sent its request (send_timeout_s {SEND_S}); "
          f"server RSS growth {growth:.1f} MiB; generated {stats['generated_tokens']} tokens so far")
    assert SEND_S <= cut_after < 20
    assert growth < 64
