"""API keys: who may call the gateway, and which prefix-cache partition (tenant) each key gets.

Keys are compared in constant time, every configured key on every request, so neither the key nor
which tenant's key was presented leaks through timing. Each key's tenant salt is an HMAC of the key:
requests under different keys never share cached KV blocks, so one tenant cannot learn from
time-to-first-token whether another tenant sent a prompt. A request's own `cache_salt` (vLLM
extension) partitions further inside its tenant, never across tenants.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

_SALT_KEY = b"pagedserve/prefix-cache-tenant/v1"


def tenant_salt(api_key: bytes) -> str:
    """The prefix-cache partition of the tenant holding api_key (not reversible to the key)."""
    return hmac.new(_SALT_KEY, api_key, hashlib.sha256).hexdigest()[:32]


def combined_salt(tenant: str, request_salt: str | None) -> str:
    """The engine's cache salt: the tenant's partition, then the request's own salt inside it."""
    if not tenant:
        return request_salt or ""
    return f"{tenant}:{request_salt}" if request_salt else tenant


class ApiKeys:
    """The accepted bearer tokens (none: no authentication, one shared cache partition)."""

    def __init__(self, keys: Iterable[str]):
        self._keys = [(k.encode(), tenant_salt(k.encode())) for k in dict.fromkeys(keys) if k]
        # NOTE: a tenant's tag in request ids is its key's place in the configuration, not anything
        # derived from the key: ids reach clients and logs, and must not help anyone test a key guess.
        self._tags = {salt: f"t{i}" for i, (_, salt) in enumerate(self._keys)}

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def tenant(self, token: bytes) -> str | None:
        """The tenant salt of token, or None if it is no accepted key ("" when no key is required)."""
        if not self._keys:
            return ""
        found = None
        for key, salt in self._keys:
            # NOTE: no early exit: the time taken does not depend on which key matched.
            if hmac.compare_digest(token, key):
                found = salt
        return found

    def tag(self, tenant: str) -> str:
        """The short name of a tenant (its salt) in request ids and logs; "" without keys."""
        return self._tags.get(tenant, "")

    def tenant_from_header(self, authorization: bytes | str | None) -> str | None:
        """Like tenant(), from an "Authorization: Bearer <key>" header value."""
        if isinstance(authorization, str):
            authorization = authorization.encode()
        scheme, _, token = (authorization or b"").partition(b" ")
        if self._keys and scheme.lower() != b"bearer":
            return None
        return self.tenant(token.strip())
