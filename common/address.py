"""Network addresses of the form ``scheme://host:port``, parsed and written in one place.

Every process binds, advertises and dials such addresses: the data plane's endpoints
(``tcp://``, ``shm://``, ``ucx://``), ZeroMQ sockets (``tcp://``) and the pool's events.
IPv6 hosts go in brackets (``tcp://[fd00::7]:5580``); an unbracketed one
(``tcp://::1:7000``) is still read, since the port is always after the last colon.

A process that binds every interface says so with a wildcard host (``WILDCARD_HOSTS``);
peers cannot dial that, so whoever hands the address on puts a real host in its place
(``with_host``). Imports nothing beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass

WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]", "")
"""Hosts that mean "every interface": bindable, never dialable."""

# Characters no host (name, IPv4, IPv6 without brackets, '*') holds: an address with one
# of them in its host part is something else (an ipc path, a URL with a user or a path).
_NOT_IN_HOST = frozenset("/\\@?#[] \t\r\n")


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed address; ``host`` has no brackets and is "" when the address names none."""

    scheme: str
    host: str
    port: int

    @property
    def is_wildcard(self) -> bool:
        return is_wildcard(self.host)

    def __str__(self) -> str:
        return format_address(self.scheme, self.host, self.port)


def is_wildcard(host: str) -> bool:
    """Whether ``host`` (bracketed or not) means every interface."""
    return host in WILDCARD_HOSTS


def parse_address(address: str, scheme: str | None = None) -> Address:
    """``"scheme://host:port"`` -> ``Address``; ValueError if malformed or, when
    ``scheme`` is given, of another scheme. The host may be empty (a wildcard)."""
    expected = f"{scheme or 'scheme'}://host:port"
    if not isinstance(address, str):
        raise ValueError(f"not an address ({expected}): {address!r}")
    kind, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            host = "[]"  # brackets are for IPv6 only: rejected below
    if (
        not sep
        or not kind
        or (scheme is not None and kind != scheme)
        or not colon
        or _NOT_IN_HOST.intersection(host)
        or not (port.isascii() and port.isdigit())
        or int(port) > 65535
    ):
        what = f"a {scheme} address" if scheme else "an address"
        raise ValueError(f"not {what} ({expected}): {address!r}")
    return Address(kind, host, int(port))


def format_address(scheme: str, host: str, port: int) -> str:
    """The address of ``host`` (IPv6 bracketed or not) and ``port`` under ``scheme``."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return f"{scheme}://[{bare}]:{port}" if ":" in bare else f"{scheme}://{bare}:{port}"


def dial_target(address: str, scheme: str) -> tuple[str, int]:
    """``(host, port)`` to connect to for a ``scheme`` address; ValueError if malformed
    or if it names no host."""
    parsed = parse_address(address, scheme)
    if not parsed.host:
        raise ValueError(f"not a {scheme} address ({scheme}://host:port): {address!r}")
    return parsed.host, parsed.port


def with_host(address: str, host: str) -> str:
    """``address`` with its wildcard host replaced by ``host``; unchanged when its host
    is not a wildcard or ``host`` is one too. ValueError if ``address`` is malformed."""
    parsed = parse_address(address)
    if not parsed.is_wildcard or is_wildcard(host):
        return address
    return format_address(parsed.scheme, host, parsed.port)


def bind_host(address: str) -> str:
    """The host to bind a plain socket (an HTTP server) beside the ZeroMQ socket bound at
    ``address``: its own host, "0.0.0.0" only for a wildcard. ValueError if malformed."""
    host = parse_address(address).host
    return "0.0.0.0" if is_wildcard(host) else host
