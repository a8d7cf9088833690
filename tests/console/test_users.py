"""Console users: scrypt hashes (salted, their parameters stored, checked in constant time), the store's table
(SQLite and PostgreSQL, audited), `inferd console user ...`, and sessions that end when the user changes."""
import functools
import io

import pytest

from inferd.cli import main
from inferd.console import users
from inferd.console.signin import ADMIN, USER_RECHECK_S, VIEWER, Sessions
from inferd.gateway.store import Store, StoreError
from tests.console.test_signin import Clock
from tests.gateway.services import postgres_url


def test_a_password_hash_is_salted_scrypt_with_its_parameters(monkeypatch):
    stored = users.hash_password("correct horse")  # the real parameters, once (about 0.7 s)
    assert stored.startswith(f"scrypt${2 ** 17}$8$1$") and "correct" not in stored
    assert users.verify_password("correct horse", stored)
    monkeypatch.setattr(users, "N", 2 ** 10)  # the rest with cheap hashes: each verifies by its own parameters
    a, b = users.hash_password("correct horse"), users.hash_password("correct horse")
    assert a != b and a.startswith("scrypt$1024$8$1$")  # salted
    assert users.verify_password("correct horse", a) and users.verify_password("correct horse", b)
    assert not users.verify_password("correct hors", a) and not users.verify_password("", a)
    other = "scrypt$2048$8$1$" + a.split("$", 4)[4]  # same salt and hash, other parameters: another hash
    assert not users.verify_password("correct horse", other)
    for broken in ("", "plain", "bcrypt$1$2$3$4$5", "scrypt$x$8$1$aa$bb", f"scrypt${2 ** 30}$8$1$aa$bb"):
        assert not users.verify_password("correct horse", broken)
    with pytest.raises(ValueError):
        users.hash_password("short")
    with pytest.raises(ValueError):
        users.check_user("bad name")
    with pytest.raises(ValueError):
        users.check_user("ok", "root")


@pytest.fixture(autouse=True)
def cheap_hashes(request, monkeypatch):
    """Fast hashes for the tests of what is built on them (the first test checks the real parameters)."""
    if request.node.name != "test_a_password_hash_is_salted_scrypt_with_its_parameters":
        monkeypatch.setattr(users, "N", 2 ** 10)
        monkeypatch.setattr(users, "_dummy", functools.cache(lambda: users.hash_password("a-dummy-password")))


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'inferd.db'}" if request.param == "sqlite" else postgres_url()
    s = Store(url)
    s.migrate()
    yield s
    s.close()


def test_users_are_stored_by_hash_checked_and_audited(store):
    store.create_console_user("alice", ADMIN, users.hash_password("alice-password"), actor="cli:test")
    with pytest.raises(StoreError):
        store.create_console_user("alice", VIEWER, users.hash_password("another-one"))
    assert users.check_sign_in(store, "alice", "alice-password")["role"] == ADMIN
    assert users.check_sign_in(store, "alice", "wrong-password") is None
    calls = users._dummy.cache_info().hits + users._dummy.cache_info().misses
    assert users.check_sign_in(store, "nobody", "alice-password") is None
    assert users._dummy.cache_info().hits + users._dummy.cache_info().misses == calls + 1  # hashed all the same
    assert users.check_sign_in(store, "bad name!", "x") is None
    assert store.update_console_user("alice", "cli:test", users.hash_password("new-password"), VIEWER)
    assert users.check_sign_in(store, "alice", "alice-password") is None
    assert users.check_sign_in(store, "alice", "new-password")["role"] == VIEWER
    assert store.console_users()[0].keys() == {"name", "role", "created_unix_s", "updated_unix_s"}
    assert store.remove_console_user("alice", "cli:test") and not store.remove_console_user("alice")
    assert not store.update_console_user("alice", "cli:test", role=ADMIN)
    assert [(a["action"], a["target"], a["actor"]) for a in store.audit()] == [
        ("user.remove", "alice", "cli:test"), ("user.update", "alice", "cli:test"),
        ("user.create", "alice", "cli:test")]
    assert "password" not in str(store.audit()[1]["detail"]).replace("'password': 'changed'", "")


def test_the_cli_adds_lists_changes_and_removes_users_reading_passwords_from_stdin(tmp_path, monkeypatch, capsys):
    db = ["--db", f"sqlite:///{tmp_path / 'inferd.db'}"]
    monkeypatch.setattr("sys.stdin", io.StringIO("first-password\n"))
    assert main(["console", "user", "add", "bob", "--role", "admin", "--password-stdin", *db]) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("short\n"))
    assert main(["console", "user", "add", "carol", "--password-stdin", *db]) == 2
    assert "8 to 1024 characters" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("second-password\n"))
    assert main(["console", "user", "passwd", "bob", "--password-stdin", *db]) == 0
    assert main(["console", "user", "passwd", "bob", "--keep-password", "--role", "viewer", *db]) == 0
    capsys.readouterr()
    assert main(["console", "user", "list", "--format", "csv", *db]) == 0
    listing = capsys.readouterr().out
    assert "bob,viewer," in listing and "password" not in listing
    store = Store(db[1])
    assert users.check_sign_in(store, "bob", "second-password")["role"] == VIEWER
    assert main(["console", "user", "remove", "bob", *db]) == 0 and main(["console", "user", "remove", "bob", *db]) == 1
    assert [a["action"] for a in store.audit()] == ["user.remove", "user.update", "user.update", "user.create"]
    store.close()


def test_a_users_session_ends_when_the_store_no_longer_holds_the_same_user():
    clock = Clock()
    sessions = Sessions(None, None, clock=clock)
    user = {"name": "dan", "role": ADMIN, "password_hash": "h1"}
    s = sessions.open(ADMIN, "1.2.3.4", user)
    assert s.actor == "console-user:dan@1.2.3.4" and not sessions.recheck_due(s)
    clock.t += USER_RECHECK_S + 1
    assert sessions.recheck_due(s) and sessions.confirmed(s, user) and not sessions.recheck_due(s)
    clock.t += USER_RECHECK_S + 1
    assert not sessions.confirmed(s, user | {"password_hash": "h2"}) and sessions.find(s.id) is None
    t = sessions.open(ADMIN, "1.2.3.4", user)
    assert not sessions.confirmed(t, user | {"role": VIEWER}) and sessions.find(t.id) is None
    u = sessions.open(ADMIN, "1.2.3.4", user)
    assert not sessions.confirmed(u, None) and sessions.find(u.id) is None
    assert not sessions.recheck_due(sessions.sign_in("", "x") or sessions.open(VIEWER, "x"))  # a key's: never


def test_signing_in_by_name_and_password_through_the_console_routes(tmp_path):
    from starlette.testclient import TestClient

    from inferd.console.routes import Console
    from inferd.gateway.app import build_gateway_app
    from inferd.gateway.auth import AUTH_FAILURE_BURST
    from tests.gateway.test_lifecycle import Replicas, deployment, make_gateway, ok
    gw, _ = make_gateway(tmp_path, Replicas(a=ok), [deployment("m", "a")], admin_key="the-admin-key")
    gw.store.create_console_user("eve", ADMIN, users.hash_password("eve-password"))
    app = build_gateway_app(gw, Console(gw).routes())
    origin = {"origin": "http://gw"}

    def sign_in(client, password: str) -> str:
        r = client.post("/console/sign-in", data={"user": "eve", "key": password}, headers=origin,
                        follow_redirects=False)
        assert r.status_code == 303
        return r.headers["location"]
    with TestClient(app, base_url="http://gw", client=("10.0.0.1", 1)) as c:
        assert sign_in(c, "not-eves-password") == "/console?error=wrong_password" and not c.cookies
        assert "Wrong user name or password" in c.get("/console?error=wrong_password").text
        assert sign_in(c, "eve-password") == "/console" and c.cookies.get("inferd_console")
        page = c.get("/console").text
        assert "eve · admin" in page
        csrf = page.split('name="csrf-token" content="', 1)[1].split('"', 1)[0]
        r = c.post("/console/api/keys", json={"tenant": "t"}, headers=origin | {"x-csrf-token": csrf})
        assert r.status_code == 201, r.text
        assert gw.store.audit(1)[0]["actor"] == "console-user:eve@10.0.0.1"
        # guesses at one user from many addresses: the user's own bucket runs out, whoever asks next
        for i in range(AUTH_FAILURE_BURST + 5):  # (the bucket refills at about one a second meanwhile)
            if sign_in(TestClient(app, base_url="http://gw", client=(f"10.1.0.{i}", 1)), "guess") \
                    == "/console?error=too_many_attempts":
                break
        assert AUTH_FAILURE_BURST - 2 <= i < AUTH_FAILURE_BURST + 4, i
        fresh = TestClient(app, base_url="http://gw", client=("10.2.0.1", 1))
        assert sign_in(fresh, "eve-password") == "/console?error=too_many_attempts"
