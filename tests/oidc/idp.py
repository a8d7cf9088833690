"""The identity provider the OIDC tests and benchmarks/oidc.py sign in through: oidc-provider (provider.mjs, from
npm: `npm ci` here, which make install-test runs) on a loopback port, with the accounts, apps and audiences below."""
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx

HERE = Path(__file__).parent
API = "https://inferd.test/api"
OTHER_API = "https://other.test/api"
CONSOLE_SECRET = "console-client-secret-for-tests"
APPS = {  # client id: (tenant claim, access token lifetime)
    "app-a": ("team-a", 300), "app-short": ("team-a", 1), "app-ghost": ("no-such-tenant", 300)}
ACCOUNTS = {"alice": {"groups": ["inferd-admins"], "preferred_username": "alice"},
            "bob": {"groups": ["team-a-people"], "inferd_tenant": "team-a", "preferred_username": "bob"},
            "carol": {"groups": ["sales"], "preferred_username": "carol"}}


class Unavailable(RuntimeError):
    """node or the npm package is missing."""


def signing_key(kid: str) -> dict:
    from joserfc.jwk import RSAKey
    return RSAKey.generate_key(2048, parameters={"kid": kid, "use": "sig", "alg": "RS256"}).as_dict(private=True)


class IdentityProvider:
    """oidc-provider on a fixed loopback port, (re)started with the signing keys given (the first signs)."""

    def __init__(self, folder: Path, port: int, gateway_port: int):
        self.folder, self.port, self.gateway_port = folder, port, gateway_port
        self.issuer = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        node = shutil.which("node")
        if node is None or not (HERE / "node_modules" / "oidc-provider").is_dir():
            raise Unavailable("the test identity provider (node, and `npm ci` in tests/oidc: make install-test does it)")
        self.node = node

    def start(self, *keys: dict) -> None:
        setup = {"port": self.port, "jwks": {"keys": list(keys)}, "accounts": ACCOUNTS, "resources": [API, OTHER_API],
                 "clients": [{"client_id": "inferd-console", "client_secret": CONSOLE_SECRET,
                              "redirect_uris": [f"http://127.0.0.1:{self.gateway_port}/console/oidc/callback"],
                              "grant_types": ["authorization_code"], "response_types": ["code"]}]
                 + [{"client_id": app, "client_secret": f"{app}-secret-0123456789",
                     "grant_types": ["client_credentials"], "redirect_uris": [], "response_types": [],
                     "inferd_tenant": tenant, "token_ttl_s": ttl} for app, (tenant, ttl) in APPS.items()]}
        (self.folder / "provider.json").write_text(json.dumps(setup))
        with (self.folder / "provider.log").open("a") as log:
            self.proc = subprocess.Popen([self.node, str(HERE / "provider.mjs"), str(self.folder / "provider.json")],
                                         stdout=log, stderr=subprocess.STDOUT)
        for _ in range(400):
            try:
                if httpx.get(f"{self.issuer}/.well-known/openid-configuration", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError(f"the identity provider did not start:\n{(self.folder / 'provider.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.proc = None




def app_token(issuer: str, app: str, resource: str = API) -> str:
    """A client-credentials access token of the app's."""
    r = httpx.post(f"{issuer}/token", data={"grant_type": "client_credentials", "resource": resource},
                   auth=(app, f"{app}-secret-0123456789"), timeout=10)
    r.raise_for_status()
    return r.json()["access_token"]
