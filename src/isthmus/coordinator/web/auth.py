"""Who may see the run: the token as a bearer header, or a session cookie the login sets.

A browser cannot put a header on the page's event stream, so the login form (or the token in the
URL fragment, which the page posts itself) exchanges the token for a cookie. The cookie holds
not the token but an HMAC of it: reading it from a browser profile gives read access to this
dashboard and ``/metrics`` only. The peers' API (register, begin, commit, ...) takes only the
bearer header, so a page on another site cannot use the cookie to act as a peer; the cookie is
also ``SameSite=Strict`` and ``HttpOnly``.

Cookies are shared by every port of a host, so the cookie's name carries the coordinator's port:
two coordinators on one machine (with different tokens) do not log each other out.
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

__all__ = ["TokenCheck"]

_PURPOSE = b"isthmus dashboard session v1"


class TokenCheck:
    """Checks requests against one run's token."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self._session = hmac.new(self._token, _PURPOSE, hashlib.sha256).hexdigest()

    @staticmethod
    def cookie_name(port: int) -> str:
        return f"isthmus_session_{port}"

    def token_ok(self, token: str) -> bool:
        """Constant-time comparison with the run's token."""
        return bool(token) and hmac.compare_digest(token.encode(), self._token)

    def allowed(self, request: web.Request, port: int) -> bool:
        """A bearer token or this coordinator's session cookie."""
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer ") and self.token_ok(header[7:]):
            return True
        cookie = request.cookies.get(self.cookie_name(port), "")
        return bool(cookie) and hmac.compare_digest(cookie.encode(), self._session.encode())

    def set_cookie(self, response: web.StreamResponse, port: int) -> None:
        # a session cookie (no max-age): closing the browser logs out
        response.set_cookie(
            self.cookie_name(port), self._session, httponly=True, samesite="Strict", path="/"
        )

    def clear_cookie(self, response: web.StreamResponse, port: int) -> None:
        response.del_cookie(self.cookie_name(port), path="/")
