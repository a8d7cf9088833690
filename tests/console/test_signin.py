"""Console sessions: roles by key, expiry (absolute and idle), failed sign-ins limited per address, CSRF."""
from inferd.console.signin import ADMIN, IDLE_TTL_S, SESSION_TTL_S, VIEWER, Sessions, csrf_ok


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_admin_and_viewer_keys_sign_in_with_their_roles_and_others_do_not():
    sessions = Sessions("adm", "view", clock=Clock())
    assert sessions.sign_in("adm", "a").role == ADMIN and sessions.sign_in("view", "a").role == VIEWER
    assert sessions.sign_in("admx", "a") is None and sessions.sign_in("", "a") is None
    assert not Sessions(None, None).enabled and Sessions(None, None).sign_in("", "a") is None


def test_sessions_expire_when_idle_and_after_their_lifetime():
    clock = Clock()
    sessions = Sessions("adm", None, clock=clock)
    s = sessions.sign_in("adm", "a")
    clock.t += IDLE_TTL_S - 1
    assert sessions.find(s.id) is s  # used: the idle timer restarts
    clock.t += IDLE_TTL_S - 1
    assert sessions.find(s.id) is s
    clock.t += IDLE_TTL_S + 1
    assert sessions.find(s.id) is None
    t = sessions.sign_in("adm", "a")
    for _ in range(int(SESSION_TTL_S // (IDLE_TTL_S / 2)) + 1):
        clock.t += IDLE_TTL_S / 2
        sessions.find(t.id)
    assert sessions.find(t.id) is None  # past SESSION_TTL_S however busy
    sessions.sign_out("nothing")


def test_failed_sign_ins_are_limited_per_address():
    clock = Clock()
    sessions = Sessions("adm", None, clock=clock)
    for _ in range(20):
        assert sessions.failures.retry_after_s("1.2.3.4") == 0
        sessions.sign_in("guess", "1.2.3.4")
    assert sessions.failures.retry_after_s("1.2.3.4") > 0 and sessions.failures.retry_after_s("5.6.7.8") == 0
    clock.t += 1.0
    assert sessions.failures.retry_after_s("1.2.3.4") == 0  # one more try a second


def test_csrf_tokens_are_per_session():
    sessions = Sessions("adm", None, clock=Clock())
    a, b = sessions.sign_in("adm", "x"), sessions.sign_in("adm", "x")
    assert csrf_ok(a, a.csrf_token) and not csrf_ok(a, b.csrf_token) and not csrf_ok(a, None)
    assert not csrf_ok(a, "")
