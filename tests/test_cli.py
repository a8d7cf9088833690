"""`inferd` on the command line: a bad argument is one line on stderr and exit code 2, before anything is
written; a start whose tenant 'default' has no key says how to make one."""
import os
import subprocess
import sys
import time

import pytest

from tests.server import ROOT, inferd

NO_EXTRA_MODELS = ("--embedding-model", "none", "--classical-model", "none", "--policy-model", "none")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inferd.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def one_line_error(done: subprocess.CompletedProcess, command: str) -> str:
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"inferd {command}: error: "), \
        (done.returncode, done.stderr[-2000:])
    return lines[0]


@pytest.mark.parametrize("flags, says", [(("--api-key", "short"), "at least 8 characters"),
                                         (("--max-num-seqs", "0"), "max_num_seqs"),
                                         (("--replicas", "0"), "--replicas"),
                                         (("--webhook-secret-file", "no-such-file"), "no-such-file"),
                                         (("no-such-model.gguf",), "does not exist")])
def test_a_bad_serve_flag_is_one_line_and_touches_no_store(tmp_path, flags, says):
    db = tmp_path / "inferd.db"
    done = run("serve", "--db", f"sqlite:///{db}", *NO_EXTRA_MODELS, *flags)
    assert says in one_line_error(done, "serve")
    assert not db.exists()  # no tenant 'default' without a key left behind


def test_a_kernel_cap_that_names_no_variant_is_one_line(tmp_path):
    db = f"sqlite:///{tmp_path / 'x.db'}"
    done = subprocess.run([sys.executable, "-m", "inferd.cli", "keys", "list", "--db", db], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env={**os.environ, "INFERD_KERNEL_ISA": "haswell"})
    assert "INFERD_KERNEL_ISA='haswell': expected one of avx2" in one_line_error(done, "keys")


def test_other_commands_errors_are_one_line(tmp_path):
    assert "not a store URL" in one_line_error(run("keys", "list", "--db", "no-such-scheme"), "keys")
    unreachable = run("usage", "--db", f"sqlite:///{tmp_path / 'inferd.db'}", "--reconcile", "http://127.0.0.1:9")
    one_line_error(unreachable, "usage")


def test_a_start_where_default_has_no_key_says_how_to_make_one(tmp_path):
    db = f"sqlite:///{tmp_path / 'inferd.db'}"
    inferd("tenants", "create", "default", "--db", db)  # as a start that failed after making it once left it
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "inferd.cli", "serve", "--db", db, "--port", "9",
                                 *NO_EXTRA_MODELS], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while "started replica" not in log_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the store is read before any replica starts
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    out = log_path.read_text()
    assert "inferd keys create --tenant default" in out, out[-3000:]
    assert "Created tenant" not in out
