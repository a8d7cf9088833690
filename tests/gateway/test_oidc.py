"""The rules of tokens and sign-in through an identity provider (gateway/oidc.py, console/sso.py), on keys made
here; the provider itself is real in test_oidc_e2e.py."""
import asyncio
import time

import pytest
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey

from inferd.console.sso import SignInRefused, SingleSignOn
from inferd.gateway.config import oidc_config
from inferd.gateway.oidc import Issuer, OIDCConfig, looks_like_token, stored_key_required
from inferd.gateway.policy import KeyPolicy, PolicyError, TenantPolicy
from inferd.protocol.errors import AuthenticationFailed, PermissionDenied

ISSUER = "https://idp.example"
KEY = RSAKey.generate_key(2048, parameters={"kid": "k1"})
OTHER_KEY = RSAKey.generate_key(2048, parameters={"kid": "k1"})  # the same id, another key: a forgery


def issuer_with_keys() -> Issuer:
    issuer = Issuer(ISSUER)
    issuer._keys, issuer._fetched_s = KeySet([RSAKey.import_key(KEY.as_dict(private=False))]), time.monotonic()
    return issuer


def token(claims: dict, key=KEY, alg: str = "RS256") -> str:
    base = {"iss": ISSUER, "aud": "api", "exp": int(time.time()) + 60, "sub": "app"}
    return jwt.encode({"alg": alg, "kid": "k1"}, base | claims, key)


@pytest.mark.parametrize("claims, key, message", [
    ({"aud": "another-api"}, KEY, "aud"),
    ({"iss": "https://elsewhere.example"}, KEY, "iss"),
    ({"exp": int(time.time()) - 120}, KEY, "expired"),
    ({}, OTHER_KEY, "bad_signature"),
])
def test_a_token_is_refused_for_each_check_it_fails(claims, key, message):
    with pytest.raises(AuthenticationFailed, match=message) as refused:
        asyncio.run(issuer_with_keys().check(token(claims, key), "api"))
    assert refused.value.code == "invalid_token"


def test_a_good_token_gives_its_claims_and_unsigned_ones_are_refused():
    assert asyncio.run(issuer_with_keys().check(token({"aud": ["api", "x"]}), "api"))["sub"] == "app"
    unsigned = "eyJhbGciOiJub25lIiwia2lkIjoiazEifQ." + token({}).split(".")[1] + "."
    with pytest.raises(AuthenticationFailed):
        asyncio.run(issuer_with_keys().check(unsigned, "api"))


def test_what_looks_like_a_token():
    assert looks_like_token(token({}))
    assert not looks_like_token("sk-inferd-0123456789abcdefghijklmnop")
    assert not looks_like_token("eyJ.only-one-dot")


def test_batches_and_async_jobs_need_a_stored_key():
    tenant = TenantPolicy("t1", "team-a")
    stored_key_required(KeyPolicy("k1", tenant), "Batches")
    with pytest.raises(PermissionDenied) as refused:
        stored_key_required(KeyPolicy("tok_1", tenant, from_token=True), "Batches")
    assert refused.value.code == "api_key_required"


def test_groups_map_to_the_highest_role_and_a_member_needs_its_tenant():
    sso = SingleSignOn(Issuer(ISSUER), OIDCConfig(ISSUER, client_id="console",
                                                  roles={"ops": "admin", "watch": "viewer", "team": "member"}))
    assert sso.identity({"sub": "1", "preferred_username": "al", "groups": ["team", "ops"]}).role == "admin"
    assert sso.identity({"sub": "1", "groups": "watch"}).role == "viewer"  # a claim given as one string
    member = sso.identity({"sub": "1", "email": "b@x", "groups": ["team"], "inferd_tenant": "team-a"})
    assert (member.name, member.role, member.tenant) == ("b@x", "member", "team-a")
    for claims in ({"sub": "1", "groups": ["team"]}, {"sub": "1", "groups": ["sales"]}, {"sub": "1"}):
        with pytest.raises(SignInRefused):
            sso.identity(claims)


def test_the_oidc_section_of_the_gateway_config(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERD_OIDC_CLIENT_SECRET", "from-the-environment")
    config = oidc_config({"issuer": ISSUER, "client_id": "console", "roles": {"ops": "admin"}})
    assert config.client_secret == "from-the-environment" and "from-the-environment" not in repr(config)
    secret = tmp_path / "secret"
    secret.write_text("from-a-file\n")
    assert oidc_config({"issuer": ISSUER, "audience": "api",
                        "client_secret_file": str(secret)}).client_secret == "from-a-file"
    for raw, message in (({"audience": "api"}, "oidc.issuer: required"),
                         ({"issuer": "idp.example", "audience": "api"}, "an http"),
                         ({"issuer": ISSUER}, "set audience"),
                         ({"issuer": ISSUER, "audience": "api", "roles": {"ops": "root"}}, "oidc.roles.ops"),
                         ({"issuer": ISSUER, "audience": "api", "client_secret": "x"}, "client_secret"),
                         ({"issuer": ISSUER, "audience": "api", "client_secret_file": str(tmp_path / "no")},
                          "client_secret_file")):
        with pytest.raises(PolicyError, match=message):
            oidc_config(raw)


def test_a_provider_that_does_not_answer_is_a_503_not_a_refused_token():
    from inferd.protocol.errors import ServiceUnavailable
    from tests.server import free_port

    async def main():
        issuer = Issuer(f"http://127.0.0.1:{free_port()}")  # nothing listens there
        await issuer.start()  # logs, does not raise: the gateway still starts
        try:
            with pytest.raises(ServiceUnavailable) as down:
                await issuer.check(token({"iss": issuer.issuer}), "api")
            assert down.value.code == "identity_provider_unavailable"
        finally:
            await issuer.close()
    asyncio.run(main())
