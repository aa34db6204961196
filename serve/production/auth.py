"""Who may call what on the production ingress (`serve/production/ingress.py`): user keys for the OpenAI routes, `/metrics`,
`/v1/config` and the live feed; admin keys for those too and, alone, for the closed loop's control routes (the
rules: `serve.production.settings`). Keys are compared in constant time, every key of both lists each time.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from serve.http_errors import RequestRejected
from serve.production.settings import ProductionSettings, admin_access

__all__ = ["IngressAuth"]


class IngressAuth:
    """The ingress's key checks (a base of `OpenAIIngress`, which sets these attributes in its constructor)."""

    settings: ProductionSettings
    keys: list[bytes]
    admin_keys: list[bytes]
    bind_host: str
    enforce: bool

    def auth_summary(self) -> str:
        """For the driver's banner: what this replica enforces, from the keys it loaded and the real bind address."""
        if self.enforce:
            admins = f" + {len(self.admin_keys)} admin key(s)" if self.admin_keys else ""
            return f"required ({len(self.keys)} key(s){admins}; proxy binds {self.bind_host})"
        if self.settings.require_auth is False:
            return f"off (--no-require-auth; proxy binds {self.bind_host})"
        return f"off (proxy binds {self.bind_host}, localhost only)"

    def _key_kind(self, request: Request) -> str | None:
        """"admin" or "user" for a valid key sent, None for none."""
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        # bytes: compare_digest refuses non-ASCII str (a 500 before); headers arrive latin-1 decoded, so latin-1
        # gives back the bytes the client sent
        given = token.encode("latin-1")
        if not token:
            return None
        # every key is compared (no early exit), so timing says nothing about which list a key is in
        admin = [hmac.compare_digest(given, key) for key in self.admin_keys]
        user = [hmac.compare_digest(given, key) for key in self.keys]
        return "admin" if any(admin) else "user" if any(user) else None

    def _authorize(self, request: Request, admin: bool = False) -> None:
        if admin:
            status = admin_access(self.bind_host, len(self.keys), len(self.admin_keys), self._key_kind(request))
            if status == 401:
                raise RequestRejected(401, "missing or invalid admin key (send 'Authorization: Bearer <admin key>')",
                                      "authentication_error")
            if status == 403:
                raise RequestRejected(403, f"{request.url.path} takes an admin key; "
                                      + ("a user key is not one" if self.admin_keys else
                                         "this endpoint has none: set SPECDEC_ADMIN_KEYS or --admin-key-file "
                                         "(docs/security.md)"), "permission_error")
            return
        if self.enforce and self._key_kind(request) is None:
            raise RequestRejected(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                  "authentication_error")
