"""API keys and what they scope: who may call, whose requests a client may abort, and
which prefix-cache entries a request may reuse.

With keys configured, each key is a tenant. The cache salt a request carries to the
workers is derived from its key (the salt a client gives only partitions its own
tenant's cache further), so no tenant reuses, or learns through ``cached_tokens``, the
prefix blocks of another. Without keys every client is one tenant.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any


def tenant_id(api_key: bytes) -> str:
    """A stable name for the tenant of ``api_key`` that does not reveal the key."""
    return "key-" + hashlib.sha256(api_key).hexdigest()[:16]


def tenant_salt(api_key: bytes, given: Any) -> Any:
    """The cache salt of a request made with ``api_key``: tenants never share KV blocks,
    and a salt the client gives only partitions its own tenant's cache further. A
    malformed ``given`` is passed through for validation to reject."""
    tenant = tenant_id(api_key)
    if given is None or given == "":
        return tenant
    return f"{tenant}/{given}" if isinstance(given, str) else given


class ApiKeys:
    """The keys a front-end accepts; none configured: every caller is let in."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def valid(self, given: bytes | None) -> bool:
        """Whether ``given`` is one of the keys (compared in constant time)."""
        if given is None:
            return False
        return any(hmac.compare_digest(given, k) for k in self._keys)
