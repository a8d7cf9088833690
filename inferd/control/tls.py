"""TLS on the gateway's public port: the certificate and key reloaded without a restart.

uvicorn builds one SSLContext from --ssl-certfile/--ssl-keyfile; a handshake takes the context's certificate as
it is at that moment. So loading the files again into the same context is the whole reload: connections open
(and streams running) keep the session they have, new connections get the new certificate. It happens on
SIGHUP, and when either file changes (polled every POLL_S: a renewal tool that replaces the files needs no
signal). A pair that does not load (half written, a key that does not match) is logged and the old one kept.
The certificate's expiry is a gauge on /metrics, read from the file at each scrape (InferdCertificateExpiringSoon)."""
import asyncio
import logging
import os
import ssl
from collections.abc import Iterator
from pathlib import Path

from cryptography import x509
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("inferd")

POLL_S = 1.0


def check_pair(certfile: Path, keyfile: Path | None) -> None:
    """ValueError, one line, unless the certificate (and key) load."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--ssl-certfile {certfile}: does not load with its key ({exc})") from None


class CertificateReloader:
    def __init__(self, context: ssl.SSLContext, certfile: Path, keyfile: Path | None):
        self.context, self.certfile, self.keyfile = context, certfile, keyfile
        self._seen = self._stamps()

    def reload(self) -> None:
        self._seen = self._stamps()
        try:
            self.context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            log.error("TLS certificate %s not reloaded, the one loaded before is kept: %s", self.certfile, exc)
            return
        log.info("TLS certificate %s reloaded: new connections get it", self.certfile)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            if self._stamps() != self._seen:
                self.reload()

    def _stamps(self) -> tuple:
        def stamp(path: Path | None):
            try:
                st = os.stat(path) if path else None
            except OSError:
                return None
            return st and (st.st_mtime_ns, st.st_size, st.st_ino)
        return stamp(self.certfile), stamp(self.keyfile)


def expiry_metric(certfile: Path) -> Iterator[GaugeMetricFamily]:
    """The certificate's notAfter as a gauge (a GatewayMetrics source); nothing while the file does not parse."""
    try:
        expires = x509.load_pem_x509_certificate(certfile.read_bytes()).not_valid_after_utc.timestamp()
    except (OSError, ValueError):
        return
    yield GaugeMetricFamily("inferd_gateway_tls_certificate_expiry_timestamp_seconds",
                            "When the certificate the public port serves expires (Unix seconds).", value=expires)
