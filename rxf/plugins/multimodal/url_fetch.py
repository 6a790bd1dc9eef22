"""Fetching a client's http(s) media URL without letting the client reach the server's own network.

A URL a client sends is fetched by the server, from inside its network (SSRF). So every hop,
redirects included, is resolved and checked before anything is sent: each address the name
resolves to must be a public unicast one (not loopback, private, link-local, shared, reserved or
multicast) unless its host or address is in `multimodal.url_allow_hosts`. The connection then goes
to the address that was checked, not to a second lookup of the name, so a DNS answer that changes
between the check and the connection (rebinding) cannot redirect it; the name still travels as the
Host header and the TLS server name, against which the certificate is verified. Redirects are
followed by hand, at most `url_max_redirects`, each re-checked; `url_timeout_s` bounds the whole
fetch and the kind's size limit its body. Errors do not say what the far side answered, so the
server is no oracle for what listens where.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from typing import Any

import httpx

from rxf.core.config import MultimodalConfig
from rxf.core.echo import echo

logger = logging.getLogger(__name__)

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class URLNotAllowed(ValueError):
    """The URL, or a redirect from it, leads somewhere the server may not fetch from."""


def _public(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return ip.is_global and not ip.is_multicast


class AddressPolicy:
    """Which hosts may be fetched: public addresses, plus the allow-list's names and networks."""

    def __init__(self, allow: list[str]) -> None:
        self.names: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in allow:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.names.add(entry.lower().rstrip("."))

    def allows(self, ip: IPAddress) -> bool:
        return _public(ip) or any(ip in net for net in self.networks)

    def resolve(self, host: str, port: int) -> str:
        """The address to connect to for `host`: every address it resolves to must be allowed (a
        name allow-listed itself is trusted whatever it resolves to)."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            raise URLNotAllowed(f"the host {echo(host)} does not resolve") from None
        addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
        if host.lower().rstrip(".") not in self.names:
            refused = [ip for ip in addresses if not self.allows(ip)]
            if refused:
                raise URLNotAllowed(
                    f"the host {echo(host)} resolves to {refused[0]}, a loopback, private, link-local or "
                    "reserved address (multimodal.url_allow_hosts allows such hosts or networks)"
                )
        return str(addresses[0])


def fetch(url: str, limits: MultimodalConfig, max_bytes: int) -> bytes:
    """The body of `url` (http or https) within the config's limits. Raises URLNotAllowed for a
    URL or redirect that may not be fetched, ValueError for any other failure (why, but not what
    the far side said)."""
    policy = AddressPolicy(limits.url_allow_hosts)
    deadline = time.monotonic() + limits.url_timeout_s
    with httpx.Client(trust_env=False, follow_redirects=False) as client:  # no proxy from the environment
        for _ in range(limits.url_max_redirects + 1):
            target = httpx.URL(url)
            if target.scheme not in ("http", "https") or not target.host:
                raise URLNotAllowed(f"only http(s) URLs may be fetched, got {echo(url)}")
            port = target.port or (443 if target.scheme == "https" else 80)
            address = policy.resolve(target.host, port)
            request = client.build_request(
                "GET",
                target.copy_with(host=address),
                headers={"Host": target.netloc.decode("ascii")},
                extensions={"sni_hostname": target.host, "timeout": _timeout(deadline)},
            )
            try:
                response = client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise ValueError(f"cannot fetch {echo(url)}: {type(exc).__name__}") from None
            try:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    url = str(target.join(response.headers["location"]))
                    continue
                if response.status_code != 200:
                    logger.info("fetching a media URL answered HTTP %d", response.status_code)
                    raise ValueError(f"cannot fetch {echo(url)}: it did not answer with the file")
                return _read(response, url, max_bytes, deadline)
            finally:
                response.close()
    raise URLNotAllowed(f"{echo(url)} redirects more than multimodal.url_max_redirects = {limits.url_max_redirects} times")


def _timeout(deadline: float) -> dict[str, Any]:
    left = max(deadline - time.monotonic(), 0.001)
    return {"connect": left, "read": left, "write": left, "pool": left}


def _read(response: httpx.Response, url: str, max_bytes: int, deadline: float) -> bytes:
    data = bytearray()
    try:
        for chunk in response.iter_bytes():
            data += chunk
            if len(data) > max_bytes:
                raise ValueError(f"the file at {echo(url)} exceeds {max_bytes} bytes")
            if time.monotonic() > deadline:
                raise ValueError(f"fetching {echo(url)} took longer than multimodal.url_timeout_s")
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot fetch {echo(url)}: {type(exc).__name__}") from None
    return bytes(data)
