"""benchmarks/classical.py's load: a small HTTP/1.1 client on raw asyncio streams (keep-alive connections,
Content-Length or chunked answers), light enough to send a few thousand requests a second from the same
two cores the servers run on; open-loop arrivals at a fixed rate and closed-loop client batches.

Open loop: request i is due at start + i / rate whatever the server does; its latency counts from that
moment (a backlog shows up in the latency: no coordinated omission). Connections are opened as needed.
"""
import asyncio
import statistics
import time
from dataclasses import dataclass

MAX_CONNECTIONS = 512


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> "Connection":
        return cls(*await asyncio.open_connection(host, port))

    async def post(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        self.writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        status_line, *lines = (await self.reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines if line)}
        if b"content-length" in fields:
            content = await self.reader.readexactly(int(fields[b"content-length"]))
        else:  # chunked
            parts = []
            while size := int((await self.reader.readuntil(b"\r\n"))[:-2], 16):
                parts.append(await self.reader.readexactly(size + 2))
            await self.reader.readuntil(b"\r\n")
            content = b"".join(p[:-2] for p in parts)
        return int(status_line.split()[1]), content

    def close(self) -> None:
        self.writer.close()


@dataclass(slots=True)
class Target:
    host: str
    port: int
    path: str
    headers: dict[str, str]

    def head(self) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        return (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n{extra}"
                ).encode()


class Pool:
    def __init__(self, target: Target):
        self.target, self.idle, self.opened = target, [], 0

    async def post(self, body: bytes) -> tuple[int, bytes]:
        conn = self.idle.pop() if self.idle else await self._open()
        try:
            answer = await conn.post(self.target.head(), body)
        except (OSError, asyncio.IncompleteReadError):
            conn.close()
            self.opened -= 1
            raise
        self.idle.append(conn)
        return answer

    async def _open(self) -> Connection:
        self.opened += 1
        return await Connection.open(self.target.host, self.target.port)

    def close(self) -> None:
        for c in self.idle:
            c.close()


def summary(latencies_s: list[float], errors: int, rows: int, wall_s: float, sent: int) -> dict:
    ms = sorted(x * 1000 for x in latencies_s)
    p = (lambda q: round(ms[min(len(ms) - 1, int(q * len(ms)))], 2)) if ms else (lambda q: None)
    return {"requests": sent, "ok": len(ms), "errors": errors, "rows_s": round(rows / wall_s, 1),
            "p50_ms": round(statistics.median(ms), 2) if ms else None, "p99_ms": p(0.99)}


async def open_loop(target: Target, bodies: list[bytes], rate: float, duration_s: float,
                    timeout_s: float = 5.0) -> dict:
    """Single requests (each body one row) at `rate` per second for duration_s."""
    pool, latencies, errors, tasks = Pool(target), [], 0, []
    loop = asyncio.get_running_loop()

    async def one(due: float, body: bytes) -> None:
        nonlocal errors
        try:
            status, _ = await asyncio.wait_for(pool.post(body), timeout_s)
            if status == 200:
                latencies.append(loop.time() - due)
            else:
                errors += 1
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            errors += 1

    count, start = int(rate * duration_s), loop.time() + 0.05
    for i in range(count):
        due = start + i / rate
        if (wait := due - loop.time()) > 0:
            await asyncio.sleep(wait)
        if pool.opened - len(pool.idle) >= MAX_CONNECTIONS:
            errors += 1
            continue
        tasks.append(asyncio.create_task(one(due, bodies[i % len(bodies)])))
    await asyncio.gather(*tasks)
    wall_s = loop.time() - start
    pool.close()
    return summary(latencies, errors, len(latencies), max(wall_s, duration_s), count)


async def closed_loop(target: Target, bodies: list[bytes], rows_per_body: int, clients: int,
                      duration_s: float) -> dict:
    """`clients` loops, each sending its next body as soon as the last answered, for duration_s."""
    pool, latencies, errors, sent = Pool(target), [], 0, 0
    end = time.perf_counter() + duration_s

    async def client(k: int) -> None:
        nonlocal errors, sent
        i = k
        while time.perf_counter() < end:
            t = time.perf_counter()
            sent += 1
            status, _ = await pool.post(bodies[i % len(bodies)])
            if status == 200:
                latencies.append(time.perf_counter() - t)
            else:
                errors += 1
            i += clients

    started = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    wall_s = time.perf_counter() - started
    pool.close()
    return summary(latencies, errors, len(latencies) * rows_per_body, wall_s, sent)
