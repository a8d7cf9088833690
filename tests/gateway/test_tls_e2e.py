"""HTTPS on `inferd serve`'s public port (--ssl-certfile/--ssl-keyfile), with certificates made by openssl: a
stream that runs across a certificate reload completes; new connections see the new certificate, after SIGHUP
and after the files are replaced without a signal; a pair that does not load is refused at start in one line."""
import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from cryptography import x509

from tests.gateway.services import missing
from tests.server import ROOT, free_port

KEY = "sk-test-tls-key"


def certificate(folder: Path, name: str) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        missing("openssl")
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


def served_certificate(port: int) -> bytes:
    """The DER certificate a new connection is handed."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return tls.getpeercert(binary_form=True)


def trusting(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


def der(cert: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())


def command(folder: Path, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "inferd.cli", "serve", "--dtype", "float32", "--port", str(port),
            "--db", f"sqlite:///{folder / 'inferd.db'}", "--usage-journal", str(folder / "usage.journal"),
            "--files-dir", str(folder / "files"), "--api-key", KEY, "--max-model-len", "512", "--kv-cache-gib",
            "0.25", "--embedding-model", "none", "--classical-model", "none", "--policy-model", "none", *args]


def test_a_certificate_is_reloaded_without_dropping_a_stream(tmp_path):
    live_cert, live_key = tmp_path / "live.crt", tmp_path / "live.key"
    a, b = certificate(tmp_path, "a"), certificate(tmp_path, "b")
    shutil.copy(a[0], live_cert)
    shutil.copy(a[1], live_key)
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(command(tmp_path, port, "--ssl-certfile", str(live_cert), "--ssl-keyfile", str(live_key)),
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/ready", verify=trusting(a[0]), timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.25)
        assert served_certificate(port) == der(a[0])
        metrics = httpx.get(f"{url}/metrics", verify=trusting(a[0])).text  # InferdCertificateExpiringSoon reads it
        expires = x509.load_pem_x509_certificate(a[0].read_bytes()).not_valid_after_utc.timestamp()
        said = [float(line.split()[1]) for line in metrics.splitlines()
                if line.startswith("inferd_gateway_tls_certificate_expiry_timestamp_seconds ")]
        assert said == [expires]

        chunks, done = [], threading.Event()

        def stream() -> None:  # a long stream on a connection made with certificate a
            with httpx.Client(base_url=url, verify=trusting(a[0]), timeout=120) as client:
                body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Count."}],
                        "max_tokens": 120, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                with client.stream("POST", "/v1/chat/completions", json=body,
                                   headers={"authorization": f"Bearer {KEY}"}) as r:
                    chunks.extend(line for line in r.iter_lines() if line)
            done.set()
        threading.Thread(target=stream, daemon=True).start()
        while len(chunks) < 5:
            time.sleep(0.01)

        shutil.copy(b[0], live_cert)
        shutil.copy(b[1], live_key)
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while served_certificate(port) != der(b[0]):
            assert time.monotonic() < deadline, "the new certificate was not served after SIGHUP"
            time.sleep(0.1)
        assert not done.is_set()  # the reload came while the stream ran
        assert done.wait(120) and chunks[-1] == "data: [DONE]"
        usage = json.loads(chunks[-2].removeprefix("data: "))["usage"]  # a loaded replica sends fewer, larger chunks
        assert usage["completion_tokens"] == 120

        shutil.copy(a[0], live_cert)  # replaced again, no signal: the watcher sees the files change
        shutil.copy(a[1], live_key)
        deadline = time.monotonic() + 10
        while served_certificate(port) != der(a[0]):
            assert time.monotonic() < deadline, "the replaced files were not loaded"
            time.sleep(0.1)
        r = httpx.post(f"{url}/v1/chat/completions", verify=trusting(a[0]), timeout=60,
                       headers={"authorization": f"Bearer {KEY}"},
                       json={"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 2})
        assert r.status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "url=https://" in text and text.count("reloaded") >= 2


def test_a_pair_that_does_not_load_is_refused_at_start_in_one_line(tmp_path):
    a, b = certificate(tmp_path, "a"), certificate(tmp_path, "b")
    done = subprocess.run(command(tmp_path, free_port(), "--ssl-certfile", str(a[0]), "--ssl-keyfile", str(b[1])),
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "ssl-certfile" in line]
    assert len(lines) == 1 and "does not load with its key" in lines[0] and "Traceback" not in done.stderr
