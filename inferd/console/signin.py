"""Who is signed in to the console: sessions in this gateway's memory, behind an HTTP-only cookie.

    sign in    POST the admin key (role admin) or the viewer key (role viewer: reads, changes nothing), or a
               console user's name and password (its role; console/users.py checks the password), or through
               the identity provider (console/sso.py: admin, viewer, or member: reads its own tenant only);
               failures are limited per client address, and per user name, by the same bucket as failed API
               keys (auth.FailedAuthentications): past it the page says to wait
    session    a random id in the cookie `inferd_console` (HttpOnly, SameSite=Strict, Path=/console), valid
               for SESSION_TTL_S from sign-in and IDLE_TTL_S from its last use; a gateway restart signs
               everyone out; a user's session also ends within USER_RECHECK_S of the user's removal or
               password change (routes.py checks the store again)
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
USER_RECHECK_S = 5.0
MAX_SESSIONS = 1000  # beyond, the oldest session is signed out
ADMIN, VIEWER, MEMBER = "admin", "viewer", "member"


@dataclass(slots=True)
class Session:
    id: str
    role: str
    csrf_token: str
    address: str
    created_s: float
    used_s: float
    user: str | None = None  # a console user's name; None: signed in with a key
    password_hash: str | None = None  # the user's at sign-in: a changed password ends the session
    checked_s: float = 0.0  # when the store last confirmed the user
    sso: str | None = None  # the name the identity provider gave (console/sso.py)
    tenant: str | None = None  # a member's: the one tenant it sees

    @property
    def actor(self) -> str:
        """Who the audit log names for this session's changes."""
        if self.user:
            return f"console-user:{self.user}@{self.address}"
        return f"console-sso:{self.sso}@{self.address}" if self.sso else f"console:{self.role}@{self.address}"

    @property
    def shown_as(self) -> str:
        who = self.user or self.sso
        return f"{who} · {self.role}" + (f" of {self.tenant}" if self.tenant else "") if who else self.role


class Sessions:
    def __init__(self, admin_key: str | None, viewer_key: str | None, clock=time.monotonic,
                 failures: FailedAuthentications | None = None):
        self._keys = {role: key for role, key in ((ADMIN, admin_key), (VIEWER, viewer_key)) if key}
        self._clock = clock
        self.failures = failures or FailedAuthentications(clock=clock)
        self._open: dict[str, Session] = {}

    @property
    def enabled(self) -> bool:
        """Whether a key may sign in (console users are in the store)."""
        return bool(self._keys)

    def sign_in(self, key: str, address: str) -> Session | None:
        """A new session if the key is the admin or viewer key, else None (counted against the address).
        The caller checks failures.retry_after_s(address) first."""
        role = next((r for r, k in self._keys.items() if hmac.compare_digest(key.encode(), k.encode())), None)
        if role is None:
            self.failures.failed(address)
            return None
        return self.open(role, address)

    def open(self, role: str, address: str, user: dict | None = None, sso: str | None = None,
             tenant: str | None = None) -> Session:
        """A new session of this role (for this console user, whose password was checked; or for the person the
        identity provider signed in, a member of tenant)."""
        now = self._clock()
        session = Session(secrets.token_urlsafe(32), role, secrets.token_urlsafe(32), address, now, now,
                          sso=sso, tenant=tenant)
        if user is not None:
            session.user, session.password_hash, session.checked_s = user["name"], user["password_hash"], now
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

    def recheck_due(self, session: Session) -> bool:
        """A user's session whose user the store should confirm again now."""
        return session.user is not None and self._clock() - session.checked_s > USER_RECHECK_S

    def confirmed(self, session: Session, user: dict | None) -> bool:
        """Whether the user as stored now still holds this session (else it is signed out)."""
        if user is None or user["role"] != session.role or user["password_hash"] != session.password_hash:
            self.sign_out(session.id)
            return False
        session.checked_s = self._clock()
        return True

    def sign_out(self, session_id: str) -> None:
        self._open.pop(session_id, None)


def csrf_ok(session: Session, token: str | None) -> bool:
    return bool(token) and hmac.compare_digest(token.encode(), session.csrf_token.encode())
