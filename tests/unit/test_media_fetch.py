"""The media URL fetcher and local paths (`multimodal.allow_urls` / `allow_local_paths`) against
loopback servers: no request reaches a loopback, private or link-local address unless allow-listed,
redirects are re-checked, the connection goes to the address that was checked (DNS rebinding), the
size and time limits hold, and errors say nothing of what the far side answered or which files exist.
Only 127.0.0.0/8 is ever contacted; the other addresses are refused before any connection."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rxf.core.config import MultimodalConfig
from rxf.core.echo import echo
from rxf.plugins.multimodal.media import MediaError, media_bytes
from rxf.plugins.multimodal.url_fetch import AddressPolicy

BODY = b"\x89PNG not really, but bytes"


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.seen.append((self.path, self.headers.get("Host")))  # type: ignore[attr-defined]
        if self.path.startswith("/redirect/"):
            self.send_response(302)
            self.send_header("Location", self.path.removeprefix("/redirect/").replace("|", "/"))
            self.end_headers()
        elif self.path == "/missing":
            self.send_error(404)
        elif self.path == "/big":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"x" * 10_000)
        elif self.path == "/slow":
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(40):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
            except BrokenPipeError:  # the fetcher gave up, as it should
                pass
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ThreadingHTTPServer, ThreadingHTTPServer]]:
    """One server on 127.0.0.1 and one on 127.0.0.2 (both loopback), each recording its requests."""
    out = []
    for host in ("127.0.0.1", "127.0.0.2"):
        srv = ThreadingHTTPServer((host, 0), _Handler)
        srv.seen = []  # type: ignore[attr-defined]
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        out.append(srv)
    yield out[0], out[1]
    for srv in out:
        srv.shutdown()
        srv.server_close()


def _url(srv: ThreadingHTTPServer, path: str = "/cat.png") -> str:
    host, port = srv.server_address[:2]
    return f"http://{host}:{port}{path}"


def _config(**kwargs: object) -> MultimodalConfig:
    return MultimodalConfig(**{"allow_urls": True, "max_image_bytes": 1000, "url_timeout_s": 2.0, **kwargs})


def _fetch(url: str, config: MultimodalConfig) -> bytes:
    return media_bytes(url, config, "image_data[0]")


def test_loopback_is_refused_before_any_request(servers):
    first, _ = servers
    first.seen.clear()
    with pytest.raises(MediaError, match=r"image_data\[0\]: .*not allowed.*loopback"):
        _fetch(_url(first), _config())
    assert first.seen == []


@pytest.mark.parametrize(
    "address", ["127.0.0.1", "10.1.2.3", "192.168.0.1", "172.16.0.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
                "::1", "fd00::1", "fe80::1", "::ffff:127.0.0.1", "224.0.0.1"],
)
def test_non_public_addresses_are_refused(address):
    assert not AddressPolicy([]).allows(ipaddress.ip_address(address))  # a check: nothing is sent


def test_public_addresses_and_the_allow_list():
    assert AddressPolicy([]).allows(ipaddress.ip_address("8.8.8.8"))
    policy = AddressPolicy(["10.0.0.0/8", "127.0.0.1"])
    assert policy.allows(ipaddress.ip_address("10.9.9.9")) and policy.allows(ipaddress.ip_address("127.0.0.1"))
    assert not policy.allows(ipaddress.ip_address("127.0.0.2"))


def test_allow_listed_address_is_fetched(servers):
    first, _ = servers
    assert _fetch(_url(first), _config(url_allow_hosts=["127.0.0.1/32"])) == BODY


def test_a_redirect_is_checked_again(servers):
    first, second = servers
    first.seen.clear()
    second.seen.clear()
    to_second = _url(first, "/redirect/" + _url(second).replace("/", "|"))
    with pytest.raises(MediaError, match="127.0.0.2.*not allowed|not allowed.*127.0.0.2"):
        _fetch(to_second, _config(url_allow_hosts=["127.0.0.1"]))
    assert len(first.seen) == 1 and second.seen == []  # the redirect was read, its target never contacted
    # Allowed, the same redirect is followed; too many hops are refused.
    assert _fetch(to_second, _config(url_allow_hosts=["127.0.0.0/8"])) == BODY
    loop = _url(first, "/redirect/" + _url(first, "/redirect/" + _url(first).replace("/", "|")).replace("/", "|"))
    with pytest.raises(MediaError, match="redirects more than"):
        _fetch(loop, _config(url_allow_hosts=["127.0.0.1"], url_max_redirects=1))


def test_the_connection_goes_to_the_checked_address(servers, monkeypatch):
    """A name that resolves to an allowed address when checked and to another one afterwards (DNS
    rebinding) is still fetched from the checked one, with the name as the Host header."""
    first, second = servers
    first.seen.clear()
    second.seen.clear()
    real = socket.getaddrinfo
    answers = iter(["127.0.0.1"] + ["127.0.0.2"] * 10)

    def rebinding(host, port, *args, **kwargs):
        return real(next(answers) if host == "media.test" else host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    port = first.server_address[1]
    assert _fetch(f"http://media.test:{port}/cat.png", _config(url_allow_hosts=["127.0.0.1/32"])) == BODY
    assert first.seen == [("/cat.png", f"media.test:{port}")] and second.seen == []


def test_what_the_far_side_answered_is_not_reported(servers):
    first, _ = servers
    with pytest.raises(MediaError) as err:
        _fetch(_url(first, "/missing"), _config(url_allow_hosts=["127.0.0.1"]))
    assert "404" not in str(err.value) and "cannot fetch" in str(err.value)


def test_size_and_time_limits(servers):
    first, _ = servers
    with pytest.raises(MediaError, match="exceeds 1000 bytes"):
        _fetch(_url(first, "/big"), _config(url_allow_hosts=["127.0.0.1"]))
    start = time.monotonic()
    with pytest.raises(MediaError, match="url_timeout_s|Timeout"):
        media_bytes(_url(first, "/slow"), _config(url_allow_hosts=["127.0.0.1"], url_timeout_s=0.5), "image_data[0]")
    assert time.monotonic() - start < 2.0


def test_local_paths_do_not_reveal_which_files_exist(tmp_path: Path):
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "cat.png").write_bytes(BODY)
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"secret")
    config = MultimodalConfig(allow_local_paths=True, local_path_roots=[str(inside)])
    assert media_bytes(str(inside / "cat.png"), config, "image_data[0]") == BODY
    errors = []
    for path in (secret, tmp_path / "absent.png", inside / ".." / "secret.png", inside / "absent.png", inside):
        with pytest.raises(MediaError) as err:
            media_bytes(str(path), config, "image_data[0]")
        errors.append(str(err.value).replace(echo(str(path)), "PATH"))
    assert len(set(errors)) == 1, errors  # one message whether the file exists, is outside, or is absent


def test_bare_base64_of_a_jpeg_is_data_not_a_path(tmp_path: Path):
    # Every JPEG's base64 starts with "/9j/" (bytes FF D8 FF): it was taken for an absolute path and
    # refused under allow_local_paths = false (or opened as a file under true).
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (30, 30), (200, 10, 10)).save(buf, format="JPEG")
    jpeg = buf.getvalue()
    text = base64.b64encode(jpeg).decode()
    assert text.startswith("/9j/")
    for allow in (False, True):
        assert media_bytes(text, MultimodalConfig(allow_local_paths=allow), "image_data[0]") == jpeg
    with pytest.raises(MediaError, match="local image paths are not allowed"):  # a path is still a path
        media_bytes(str(tmp_path / "x.jpg"), MultimodalConfig(allow_local_paths=False), "image_data[0]")
