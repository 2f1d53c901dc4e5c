"""Optional bearer-token access control and TLS for the three HTTP services.

Two credentials, both optional and independent:

- **API keys** (``--api-key``, repeatable; ``--api-key-file``; ``DYN_API_KEY``): what clients of the
  product send: ``/v1/*`` on the frontend, the read routes of the standalone services.
- **Admin token** (``--admin-token`` / ``--admin-token-file`` / ``DYN_ADMIN_TOKEN``): what operators
  and control planes send to change state: the frontend's ``/admin/*``, ``POST /busy_threshold`` and
  the slot-tracker routes it serves, the standalone services' write routes. It is also accepted
  wherever an API key is.

Both travel as ``Authorization: Bearer <token>``. Several of each may be valid at once (rotation:
add the new one, roll the clients, drop the old one). Tokens are kept only as SHA-256 digests and
compared with ``hmac.compare_digest`` against every accepted digest (no early exit), so neither the
comparison time nor a log line or ``repr`` reveals them. ``/health`` and ``/metrics`` stay open.

A route's level comes from a ``classify(method, path)`` function each service supplies; the check
runs in ``AuthMiddleware`` (ASGI) and, for the services' hot routes answered inside uvicorn's
parser, in ``kvroute_common.fast_http`` through the same ``AccessPolicy.refusal``. With no token
configured no policy is built and nothing is checked: the no-auth path costs nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
from collections.abc import Callable, Iterable
from typing import Any

import orjson

OPEN, API, ADMIN = 0, 1, 2
"""Access levels: anyone; API key (or admin token) when keys are set; admin token when one is set."""

Classifier = Callable[[str, str], int]
"""(method, path) -> OPEN | API | ADMIN."""

_BEARER = b"bearer"
_AUTHORIZATION = b"authorization"


class TokenSet:
    """Accepted bearer tokens, held as SHA-256 digests and compared in constant time."""

    __slots__ = ("_digests",)

    def __init__(self, tokens: Iterable[str] = ()) -> None:
        digests = []
        for token in tokens:
            if not token or token != token.strip():
                raise ValueError("a token must be non-empty and have no surrounding whitespace")
            digests.append(hashlib.sha256(token.encode("utf-8")).digest())
        self._digests = tuple(digests)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    @property
    def digests(self) -> tuple[bytes, ...]:
        """The tokens' SHA-256 digests (what per-key rate limits name keys by)."""
        return self._digests

    def __repr__(self) -> str:  # never the tokens themselves
        return f"TokenSet(<{len(self._digests)} token(s)>)"

    def matches(self, presented: bytes | None) -> bool:
        """Whether ``presented`` is one of the tokens; every digest is compared, match or not."""
        if presented is None:
            return False
        digest = hashlib.sha256(presented).digest()
        found = False
        for ref in self._digests:
            found |= hmac.compare_digest(digest, ref)
        return found


def bearer_token(header: bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header value (scheme case-insensitive)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != _BEARER:
        return None
    token = token.strip()
    return token or None


def _service_refusal(level: int, missing: bool) -> bytes:
    what = "admin token" if level == ADMIN else "API key"
    if missing:
        return orjson.dumps({"error": f"authentication required: send `Authorization: Bearer <{what}>`"})
    return orjson.dumps({"error": f"invalid {what}"})


RefusalBody = Callable[[str, int, bool], bytes]
"""(path, level, token missing?) -> the 401 body (never echoes the presented token)."""


class AccessPolicy:
    """Who may call what: ``classify`` gives each route's level, the token sets decide."""

    def __init__(
        self, api_keys: TokenSet, admin_tokens: TokenSet, classify: Classifier, refusal_body: RefusalBody | None = None
    ) -> None:
        self.api_keys = api_keys
        self.admin_tokens = admin_tokens
        self.classify = classify
        self._body = refusal_body or (lambda path, level, missing: _service_refusal(level, missing))

    def allowed(self, level: int, token: bytes | None) -> bool:
        if level == OPEN:
            return True
        if level == API:
            if not self.api_keys:
                return True
            return self.api_keys.matches(token) or self.admin_tokens.matches(token)
        if not self.admin_tokens:
            return True
        return self.admin_tokens.matches(token)

    def refusal(self, method: str, path: str, headers: Iterable[tuple[bytes, bytes]]) -> tuple[int, bytes] | None:
        """``(401, body)`` when the request may not go on, else None. ``headers``: lower-case names."""
        level = self.classify(method, path)
        if level == OPEN:
            return None
        header = None
        for name, value in headers:
            if name == _AUTHORIZATION:
                header = value
                break
        token = bearer_token(header)
        if self.allowed(level, token):
            return None
        return 401, self._body(path, level, token is None)


UNAUTHORIZED_HEADERS = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]


class AuthMiddleware:
    """ASGI wrapper refusing (401) HTTP requests the policy does not allow; lifespan passes through."""

    def __init__(self, app: Any, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy
        self.state = getattr(app, "state", None)

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[dict[str, Any]], Any]
    ) -> None:
        if scope["type"] == "http":
            refused = self.policy.refusal(scope["method"], scope["path"], scope["headers"])
            if refused is not None:
                status, body = refused
                headers = [*UNAUTHORIZED_HEADERS, (b"content-length", b"%d" % len(body))]
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


# -- command line --------------------------------------------------------------------------------


def add_security_args(parser: argparse.ArgumentParser) -> None:
    """``--api-key``/``--api-key-file``, ``--admin-token``/``--admin-token-file``, ``--ssl-certfile``/``--ssl-keyfile``.

    Environment: ``DYN_API_KEY`` (comma-separated), ``DYN_API_KEY_FILE``, ``DYN_ADMIN_TOKEN``
    (comma-separated), ``DYN_ADMIN_TOKEN_FILE``, ``DYN_SSL_CERTFILE``, ``DYN_SSL_KEYFILE``; a flag
    given on the command line replaces its variable.
    """
    g = parser.add_argument_group("security")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="accept this bearer token on the client routes (repeatable; prefer --api-key-file: "
        "command lines are visible to other local users) [env DYN_API_KEY, comma-separated; default: no key needed]",
    )
    g.add_argument(
        "--api-key-file",
        default=os.environ.get("DYN_API_KEY_FILE"),
        metavar="FILE",
        help="file of API keys, one per line (# comments) [env DYN_API_KEY_FILE]",
    )
    g.add_argument(
        "--admin-token",
        action="append",
        default=None,
        metavar="TOKEN",
        help="bearer token required on the admin / write routes [env DYN_ADMIN_TOKEN; default: admin routes open]",
    )
    g.add_argument(
        "--admin-token-file",
        default=os.environ.get("DYN_ADMIN_TOKEN_FILE"),
        metavar="FILE",
        help="file of admin tokens, one per line [env DYN_ADMIN_TOKEN_FILE]",
    )
    g.add_argument(
        "--ssl-certfile",
        default=os.environ.get("DYN_SSL_CERTFILE"),
        metavar="PEM",
        help="serve HTTPS with this certificate chain (with --ssl-keyfile) [env DYN_SSL_CERTFILE]",
    )
    g.add_argument(
        "--ssl-keyfile",
        default=os.environ.get("DYN_SSL_KEYFILE"),
        metavar="PEM",
        help="private key of --ssl-certfile [env DYN_SSL_KEYFILE]",
    )


def read_token_file(path: str, flag: str) -> list[str]:
    """Tokens of a file, one per line; blank lines and ``#`` comments skipped. An empty file is an error
    (it would silently leave the routes open)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise SystemExit(f"{flag} {path}: cannot read: {exc.strerror}") from None
    tokens = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not tokens:
        raise SystemExit(f"{flag} {path}: no token in the file")
    return tokens


def _token_values(given: list[str] | None, env_name: str, file_path: str | None, flag: str, environ: Any) -> list[str]:
    """The flag's values (else its comma-separated variable), plus the lines of its file."""
    values = (
        list(given) if given is not None else [t.strip() for t in environ.get(env_name, "").split(",") if t.strip()]
    )
    if file_path:
        values += read_token_file(file_path, f"{flag}-file")
    return values


def _tokens(given: list[str] | None, env_name: str, file_path: str | None, flag: str, environ: Any) -> TokenSet:
    try:
        return TokenSet(_token_values(given, env_name, file_path, flag, environ))
    except ValueError as exc:
        raise SystemExit(f"{flag}: {exc}") from None


def policy_from_args(
    ns: argparse.Namespace, classify: Classifier, refusal_body: RefusalBody | None = None, environ: Any = None
) -> AccessPolicy | None:
    """The policy the flags ask for, or None when no token is configured (nothing to check)."""
    env = os.environ if environ is None else environ
    api = _tokens(ns.api_key, "DYN_API_KEY", ns.api_key_file, "--api-key", env)
    admin = _tokens(ns.admin_token, "DYN_ADMIN_TOKEN", ns.admin_token_file, "--admin-token", env)
    if not api and not admin:
        return None
    return AccessPolicy(api, admin, classify, refusal_body)


def outgoing_token(policy: AccessPolicy | None, ns: argparse.Namespace, environ: Any = None) -> str | None:
    """The bearer token a service sends to its peers (same deployment, same tokens): its admin token,
    else its first API key. Read again from the flags since the policy keeps digests only."""
    if policy is None:
        return None
    env = os.environ if environ is None else environ
    for given, env_name, file_path, flag in (
        (ns.admin_token, "DYN_ADMIN_TOKEN", ns.admin_token_file, "--admin-token"),
        (ns.api_key, "DYN_API_KEY", ns.api_key_file, "--api-key"),
    ):
        values = _token_values(given, env_name, file_path, flag, env)
        if values:
            return values[0]
    return None


def ssl_options(ns: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's ``ssl_certfile``/``ssl_keyfile`` from the flags ({} for plain HTTP); both or neither."""
    cert, key = ns.ssl_certfile, ns.ssl_keyfile
    if not cert and not key:
        return {}
    if not (cert and key):
        raise SystemExit("--ssl-certfile and --ssl-keyfile go together")
    for flag, path in (("--ssl-certfile", cert), ("--ssl-keyfile", key)):
        if not os.access(path, os.R_OK):
            raise SystemExit(f"{flag} {path}: not a readable file")
    return {"ssl_certfile": cert, "ssl_keyfile": key}


def service_classifier(read_posts: Iterable[str]) -> Classifier:
    """The standalone services' rule: ``/health`` and ``/metrics`` open; GET and the read-only POST
    routes (``read_posts``: the queries) need an API key when keys are set; every other route writes
    and needs the admin token when one is set."""
    reads = frozenset(read_posts)

    def classify(method: str, path: str) -> int:
        if path == "/health" or path == "/metrics":
            return OPEN
        if method == "GET" or method == "HEAD" or path in reads:
            return API
        return ADMIN

    return classify


__all__ = [
    "ADMIN",
    "API",
    "OPEN",
    "AccessPolicy",
    "AuthMiddleware",
    "TokenSet",
    "add_security_args",
    "bearer_token",
    "outgoing_token",
    "policy_from_args",
    "read_token_file",
    "service_classifier",
    "ssl_options",
]
