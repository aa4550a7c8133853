"""Who may see the run: the token as a bearer header, or a session cookie the login sets.

A browser cannot put a header on the page's event stream, so the login form (or the token in the
URL fragment, which the page posts itself) exchanges the token for a cookie. The cookie holds
not the token but an HMAC of it: reading it from a browser profile gives read access to this
dashboard and ``/metrics`` only. The peers' API (register, begin, commit, ...) takes only the
bearer header, so a page on another site cannot use the cookie to act as a peer; the cookie is
also ``SameSite=Strict`` and ``HttpOnly``.

The cookie names the identity that logged in (the admin's or a join token's) with an HMAC
under the admin token, so revoking a join token ends its dashboard sessions too.

Cookies are shared by every port of a host, so the cookie's name carries the coordinator's port:
two coordinators on one machine (with different tokens) do not log each other out.
"""

from __future__ import annotations

from aiohttp import web

from isthmus.coordinator.auth import Identities

__all__ = ["TokenCheck"]


class TokenCheck:
    """Checks requests against one run's credentials (any identity may read the dashboard)."""

    def __init__(self, identities: Identities) -> None:
        self.identities = identities

    @staticmethod
    def cookie_name(port: int) -> str:
        return f"isthmus_session_{port}"

    def token_ok(self, token: str) -> bool:
        """The admin token or a join token that is not revoked (constant-time comparisons)."""
        return self.identities.token_ok(token)

    def allowed(self, request: web.Request, port: int) -> bool:
        """A bearer token or this coordinator's session cookie."""
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer ") and self.token_ok(header[7:]):
            return True
        cookie = request.cookies.get(self.cookie_name(port), "")
        return bool(cookie) and self.identities.cookie_ok(cookie)

    def set_cookie(self, response: web.StreamResponse, port: int, token: str) -> None:
        """Log ``token``'s identity in (does nothing for an invalid token)."""
        value = self.identities.cookie_for(token)
        if value is None:
            return
        # a session cookie (no max-age): closing the browser logs out
        response.set_cookie(
            self.cookie_name(port), value, httponly=True, samesite="Strict", path="/"
        )

    def clear_cookie(self, response: web.StreamResponse, port: int) -> None:
        response.del_cookie(self.cookie_name(port), path="/")
