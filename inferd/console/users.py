"""Console users' passwords: made into and checked against the hash the store keeps (console_users).

Hash: scrypt (hashlib.scrypt, memory-hard) with N=2**17, r=8, p=1, the OWASP Password Storage Cheat Sheet's
minimum (128 * N * r = 128 MiB and about 0.7 s per hash on one core of the 2-core VM these figures come from;
PASSWORD_CHECKS in routes.py bounds how many run at once), a random 16-byte salt per password and a 32-byte
result, stored as
"scrypt$N$r$p$SALT$HASH" (URL-safe base64): a hash made with other parameters still verifies by its own.
A check recomputes the hash and compares in constant time; a name with no user is checked against a dummy
hash of the same cost, so the time taken does not tell which names exist.
"""
import base64
import hashlib
import hmac
import re
import secrets
from functools import cache

from inferd.console.signin import ADMIN, VIEWER

N, R, P, SALT_BYTES, HASH_BYTES = 2 ** 17, 8, 1, 16, 32
MAX_MEMORY = 256 * 1024 * 1024  # hashlib refuses past this (its default, 32 MiB, is below what N, R need)
MIN_PASSWORD, MAX_PASSWORD = 8, 1024  # characters; the upper bound keeps a sign-in's cost bounded
ROLES = (ADMIN, VIEWER)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


def check_user(name: str, role: str | None = None) -> None:
    """Raises ValueError for a name or role the store would not take."""
    if not NAME.fullmatch(name):
        raise ValueError("a user name is 1 to 64 letters, digits and . _ @ - (starting with a letter or digit)")
    if role is not None and role not in ROLES:
        raise ValueError(f"a role is one of {', '.join(ROLES)}")


def hash_password(password: str) -> str:
    if not MIN_PASSWORD <= len(password) <= MAX_PASSWORD:
        raise ValueError(f"a password has {MIN_PASSWORD} to {MAX_PASSWORD} characters")
    salt = secrets.token_bytes(SALT_BYTES)
    digest = _scrypt(password, salt, N, R, P, HASH_BYTES)
    return f"scrypt${N}${R}${P}${_b64(salt)}${_b64(digest)}"


def verify_password(password: str, stored: str) -> bool:
    """True if the password hashes to the stored hash (constant-time comparison)."""
    if len(password) > MAX_PASSWORD:
        return False
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        digest = _unb64(digest)
        return hmac.compare_digest(_scrypt(password, _unb64(salt), int(n), int(r), int(p), len(digest)), digest)
    except ValueError:  # not one of ours, or parameters past MAX_MEMORY
        return False


def check_sign_in(store, name: str, password: str) -> dict | None:
    """The user (name, role, password_hash) if name and password match, else None; as slow either way."""
    user = store.console_user(name) if NAME.fullmatch(name) else None
    ok = verify_password(password, user["password_hash"] if user else _dummy())
    return user if ok and user is not None else None


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int, length: int) -> bytes:
    return hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p, maxmem=MAX_MEMORY, dklen=length)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@cache
def _dummy() -> str:
    """A hash of a random password, made once (at the first unknown name, not at import: the CLI imports this)."""
    return hash_password(secrets.token_urlsafe(16))
