"""One API key with a TPM limit for the LiteLLM proxy, without a database.

The key and its limit come from the environment (benchmarks/gateway.py sets
them): BENCH_LITELLM_KEY, BENCH_TPM_LIMIT, optional BENCH_RPM_LIMIT. Lookup is
by SHA-256 of the presented key, as LiteLLM does for DB keys, into a table
built once at import. The returned UserAPIKeyAuth carries tpm_limit, which the
proxy's parallel_request_limiter enforces exactly as for a DB virtual key.
"""
import hashlib
import os

from fastapi import HTTPException, Request
from litellm.proxy._types import UserAPIKeyAuth


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _limit(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


_KEYS = {
    _hash(os.environ["BENCH_LITELLM_KEY"]): dict(
        key_alias="bench",
        tpm_limit=_limit("BENCH_TPM_LIMIT"),
        rpm_limit=_limit("BENCH_RPM_LIMIT"),
    )
}


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    token = _hash(api_key or "")
    fields = _KEYS.get(token)
    if fields is None:
        raise HTTPException(status_code=401, detail="invalid API key")
    return UserAPIKeyAuth(api_key=api_key, token=token, **fields)
