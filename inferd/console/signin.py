"""Who is signed in to the console: sessions in this gateway's memory, behind an HTTP-only cookie.

    sign in    POST the admin key (role admin) or the viewer key (role viewer: reads, changes nothing);
               failures are limited per client address by the same bucket as failed API keys
               (auth.FailedAuthentications), answered 429 past it
    session    a random id in the cookie `inferd_console` (HttpOnly, SameSite=Strict, Path=/console), valid
               for SESSION_TTL_S from sign-in and IDLE_TTL_S from its last use; a gateway restart signs
               everyone out
    CSRF       each session has its own random token, in the page's <meta name="csrf-token">; every POST must
               send it back (header X-CSRF-Token or form field csrf_token) and come from the same origin
"""
import hmac
import secrets
import time
from dataclasses import dataclass

from inferd.gateway.auth import FailedAuthentications

COOKIE = "inferd_console"
SESSION_TTL_S = 8 * 3600.0
IDLE_TTL_S = 30 * 60.0
MAX_SESSIONS = 1000  # beyond, the oldest session is signed out
ADMIN, VIEWER = "admin", "viewer"


@dataclass(slots=True)
class Session:
    id: str
    role: str
    csrf_token: str
    address: str
    created_s: float
    used_s: float

    @property
    def actor(self) -> str:
        """Who the audit log names for this session's changes."""
        return f"console:{self.role}@{self.address}"


class Sessions:
    def __init__(self, admin_key: str | None, viewer_key: str | None, clock=time.monotonic,
                 failures: FailedAuthentications | None = None):
        self._keys = {role: key for role, key in ((ADMIN, admin_key), (VIEWER, viewer_key)) if key}
        self._clock = clock
        self.failures = failures or FailedAuthentications(clock=clock)
        self._open: dict[str, Session] = {}

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def sign_in(self, key: str, address: str) -> Session | None:
        """A new session if the key is the admin or viewer key, else None (counted against the address).
        The caller checks failures.retry_after_s(address) first."""
        role = next((r for r, k in self._keys.items() if hmac.compare_digest(key.encode(), k.encode())), None)
        if role is None:
            self.failures.failed(address)
            return None
        now = self._clock()
        session = Session(secrets.token_urlsafe(32), role, secrets.token_urlsafe(32), address, now, now)
        self._open[session.id] = session
        if len(self._open) > MAX_SESSIONS:
            self._open.pop(next(iter(self._open)))
        return session

    def find(self, session_id: str | None) -> Session | None:
        """The live session with this id (its idle timer restarts), or None; expired ones are dropped."""
        session = self._open.get(session_id or "")
        if session is None:
            return None
        now = self._clock()
        if now - session.created_s > SESSION_TTL_S or now - session.used_s > IDLE_TTL_S:
            del self._open[session.id]
            return None
        session.used_s = now
        return session

    def sign_out(self, session_id: str) -> None:
        self._open.pop(session_id, None)


def csrf_ok(session: Session, token: str | None) -> bool:
    return bool(token) and hmac.compare_digest(token.encode(), session.csrf_token.encode())
