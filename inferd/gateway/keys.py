"""API keys: random with a recognizable prefix, shown once, stored only as a hash."""
import hashlib
import hmac
import secrets
from dataclasses import dataclass

PREFIX = "sk-inferd-"
LOOKUP_CHARS = 12  # hex after the prefix: a non-secret id to find the stored hash by


@dataclass(slots=True, frozen=True)
class NewKey:
    key: str  # shown once, never stored
    lookup_id: str
    key_hash: str

    @property
    def display(self) -> str:
        return f"{PREFIX}{self.lookup_id}..."


def generate_key() -> NewKey:
    lookup_id = secrets.token_hex(LOOKUP_CHARS // 2)
    key = f"{PREFIX}{lookup_id}{secrets.token_urlsafe(32)}"
    return NewKey(key, lookup_id, hash_key(key))


def hash_key(key: str) -> str:
    """sha256 suffices: keys carry 256 random bits, so there is nothing to brute-force."""
    return hashlib.sha256(key.encode()).hexdigest()


def lookup_id_of(key: str) -> str:
    """Ours carry it after the prefix; a key brought from elsewhere (--api-key) is found by its hash."""
    return identified(key)[0]


def identified(key: str) -> tuple[str, str]:
    """The key's lookup id and its hash, hashed once."""
    hashed = hash_key(key)
    if key.startswith(PREFIX) and len(key) >= len(PREFIX) + LOOKUP_CHARS + 16:
        return key[len(PREFIX):len(PREFIX) + LOOKUP_CHARS], hashed
    return "h" + hashed[:LOOKUP_CHARS - 1], hashed


def imported_key(key: str) -> NewKey:
    """A key chosen by the operator (e.g. `inferd serve --api-key`); stored hashed like ours."""
    if len(key) < 8:
        raise ValueError("an API key must have at least 8 characters")
    return NewKey(key, *identified(key))


def hash_matches(hashed: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hashed.encode(), stored_hash.encode())
