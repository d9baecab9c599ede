"""Who may call, and how often: bearer-token auth and one token-bucket rate limiter, shared by
the gRPC interceptor and the HTTP gateway.

A client is keyed by its authenticated token, else by its peer address. A forwarded-for header
counts only when the deployment says a trusted proxy sets it (`trust_forwarded_for`): anything
a client can write freely (an unchecked `authorization`, an `x-forwarded-for`) would let it
rotate values past the limit. The bucket table is bounded: buckets that have refilled are
forgotten (a full bucket and a missing one behave alike), and when the table is still full, new
clients share one overflow bucket instead of each getting a fresh burst.

`check` also names the client for what follows in the same task (`current_client`): admission
keys each client's share of places on it, and a call with n samples is charged n tokens (one
here, the rest by server.lifecycle once n is known; a call may overdraw a full bucket, and then
waits for the debt to refill).
"""

from __future__ import annotations

import collections
import contextvars
import hashlib
import hmac
import time
import urllib.parse
from typing import Callable, Optional, Union

from celeris.engine.errors import Overloaded
from celeris.server.errors import Unauthenticated

OVERFLOW = "overflow"
_CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("celeris_client", default="")


def current_client() -> str:
    """The key of the client whose call this task serves ("" where no guard checked it)."""
    return _CLIENT.get()
PRUNE_SCAN = 64  # oldest entries looked at per insert into a full table


def bearer_token(header: Union[str, bytes, None]) -> Optional[bytes]:
    """The credential of an `Authorization: Bearer X` value (scheme case-insensitive), as bytes;
    None if absent or another scheme. Bytes, so a non-UTF-8 header cannot raise."""
    if header is None:
        return None
    raw = header if isinstance(header, bytes) else header.encode("utf-8", "surrogateescape")
    scheme, _, credential = raw.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return credential.strip() or None


def peer_address(peer: str) -> str:
    """The address of a gRPC peer string ('ipv4:1.2.3.4:5', 'ipv6:[::1]:5', urlencoded or not),
    or an HTTP remote as it is. The port is dropped: a new connection must not be a new client."""
    peer = urllib.parse.unquote(peer or "")
    for prefix in ("ipv4:", "ipv6:"):
        if peer.startswith(prefix):
            peer = peer[len(prefix):]
            if peer.startswith("["):
                return peer[1:peer.index("]")] if "]" in peer else peer[1:]
            return peer.rsplit(":", 1)[0] if prefix == "ipv4:" else peer
    return peer


class TokenBuckets:
    """Token bucket per key, in a bounded table."""

    def __init__(self, rate_per_s: float, burst: int, max_keys: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.max_keys, self.clock = rate_per_s, burst, max_keys, clock
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def _level(self, key: str, now: float) -> Optional[float]:
        entry = self._buckets.get(key)
        if entry is None:
            return None
        tokens, last = entry
        return min(float(self.burst), tokens + (now - last) * self.rate)

    def _make_room(self, now: float) -> bool:
        for key in list(self._buckets)[:PRUNE_SCAN]:  # least recently used first
            if key != OVERFLOW and self._level(key, now) >= self.burst:
                del self._buckets[key]
        return len(self._buckets) < self.max_keys - 1  # one entry stays free for the overflow bucket

    def allow(self, key: str, cost: int = 1) -> Optional[float]:
        """None if allowed (`cost` tokens taken), else seconds until it would be. A cost above the
        burst is allowed on a full bucket and leaves it in debt."""
        now = self.clock()
        if key not in self._buckets and len(self._buckets) >= self.max_keys - 1 and not self._make_room(now):
            key = OVERFLOW
        level = self._level(key, now)
        tokens = float(self.burst) if level is None else level
        need = min(cost, self.burst)
        self._buckets[key] = (tokens - cost, now) if tokens >= need else (tokens, now)
        self._buckets.move_to_end(key)
        return None if tokens >= need else (need - tokens) / self.rate


class Guard:
    """Auth, then rate limit, for one call: `check` raises Unauthenticated or Overloaded."""

    def __init__(self, api_token: Optional[str] = None, rate_limit: float = 0.0, burst: int = 20,
                 trust_forwarded_for: bool = False, max_keys: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        self._expected = api_token.encode() if api_token else None
        self.limiter = TokenBuckets(rate_limit, burst, max_keys, clock) if rate_limit > 0 else None
        self.trust_forwarded_for = trust_forwarded_for

    def check(self, authorization: Union[str, bytes, None], peer: str, forwarded_for: Optional[str] = None) -> str:
        """Raise Unauthenticated or Overloaded, else name the client (also for `current_client`)."""
        token = bearer_token(authorization)
        authenticated = False
        if self._expected is not None:
            if token is None or not hmac.compare_digest(token, self._expected):
                raise Unauthenticated("missing or invalid bearer token ('authorization: Bearer ...')")
            authenticated = True
        key = self.client_key(token if authenticated else None, peer, forwarded_for)
        _CLIENT.set(key)
        self.charge(key, 1)
        return key

    def charge(self, key: str, cost: int) -> None:
        """Take `cost` more tokens from the client's bucket (a call's further samples), or raise Overloaded."""
        if self.limiter is None or cost <= 0:
            return
        wait = self.limiter.allow(key, cost)
        if wait is not None:
            raise Overloaded(f"rate limit of {self.limiter.rate:g} requests/s exceeded (a call with n samples is n "
                             "requests)", wait)

    def client_key(self, token: Optional[bytes], peer: str, forwarded_for: Optional[str]) -> str:
        if token is not None:
            return "token:" + hashlib.sha256(token).hexdigest()[:32]
        if self.trust_forwarded_for and forwarded_for:
            return "addr:" + forwarded_for.split(",")[-1].strip()[:64]  # the hop our proxy saw
        return "addr:" + peer_address(peer)[:64]
