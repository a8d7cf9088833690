"""The gateway's upstream transport against a real loopback server: framing, keep-alive, closed idle
connections, errors and timeouts."""
import asyncio

import httpx
import pytest

from inferd.gateway import transport as transport_module
from inferd.gateway.transport import UpstreamTransport
from tests.server import free_port


class Server:
    """HTTP/1.1 on loopback that answers each request as `reply` says and counts connections."""

    def __init__(self, reply):
        self.reply, self.connections, self.requests = reply, 0, []

    async def __aenter__(self) -> str:
        port = free_port()
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                if await self.reply(writer, len(self.requests)) == "close":
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()


async def fixed(writer, n):
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"n\": \"ok\"}")
    await writer.drain()


async def chunked(writer, n):
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    for part in (b"data: 1\n\n", b"data: 2\n\n"):
        writer.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        await writer.drain()
        await asyncio.sleep(0.01)
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def send(transport: UpstreamTransport, url: str, body: bytes = b'{"a": 1}', **timeout) -> httpx.Response:
    request = httpx.Request("POST", url + "/v1/x", content=body, headers={"content-type": "application/json"},
                            extensions={"timeout": timeout} if timeout else {})
    return await transport.handle_async_request(request)


def test_keep_alive_reuses_one_connection_and_sends_the_body():
    async def main():
        server = Server(fixed)
        async with server as url:
            transport = UpstreamTransport()
            for _ in range(3):
                r = await send(transport, url)
                assert r.status_code == 200 and await r.aread() == b'{"n": "ok"}'
                assert r.headers["content-type"] == "application/json"
            await transport.aclose()
        assert server.connections == 1 and len(server.requests) == 3
        head, body = server.requests[0]
        assert head.startswith(b"POST /v1/x HTTP/1.1\r\n") and body == b'{"a": 1}'
    asyncio.run(main())


def test_a_chunked_stream_arrives_in_pieces():
    async def main():
        async with Server(chunked) as url:
            transport = UpstreamTransport()
            r = await send(transport, url)
            assert [c async for c in r.aiter_raw()] == [b"data: 1\n\n", b"data: 2\n\n"]
            await r.aclose()
            await transport.aclose()
    asyncio.run(main())


def test_a_connection_the_server_closed_is_not_reused():
    async def close_after(writer, n):
        await fixed(writer, n)
        return "close"

    async def main():
        server = Server(close_after)
        async with server as url:
            transport = UpstreamTransport()
            for _ in range(2):
                r = await send(transport, url)
                await r.aread()
                await asyncio.sleep(0.05)  # the server's FIN arrives
            await transport.aclose()
        assert server.connections == 2
    asyncio.run(main())


def test_a_connection_idle_past_max_idle_is_not_reused(monkeypatch):
    """The server may be closing it (uvicorn after 5 s idle): a new connection is opened instead."""
    monkeypatch.setattr(transport_module, "MAX_IDLE_S", 0.2)

    async def main():
        server = Server(fixed)
        async with server as url:
            transport = UpstreamTransport()
            for pause_s in (0.0, 0.05, 0.3):  # the second reuses the first's connection, the third does not
                await asyncio.sleep(pause_s)
                r = await send(transport, url)
                await r.aread()
            await transport.aclose()
        assert server.connections == 2 and len(server.requests) == 3
    asyncio.run(main())


def test_a_stream_left_unread_closes_its_connection():
    async def main():
        server = Server(chunked)
        async with server as url:
            transport = UpstreamTransport()
            r = await send(transport, url)
            await r.aclose()  # the client went away before the end
            r = await send(transport, url)
            assert len([c async for c in r.aiter_raw()]) == 2
            await transport.aclose()
        assert server.connections == 2
    asyncio.run(main())


def test_errors_are_httpx_errors():
    async def hang(writer, n):
        await asyncio.sleep(5)

    async def cut(writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        return "close"

    async def main():
        transport = UpstreamTransport()
        with pytest.raises(httpx.ConnectError):
            await send(transport, f"http://127.0.0.1:{free_port()}")
        async with Server(hang) as url:
            with pytest.raises(httpx.ReadTimeout):
                await send(transport, url, read=0.2)
        async with Server(cut) as url:
            r = await send(transport, url)
            with pytest.raises(httpx.RemoteProtocolError):
                await r.aread()
        await transport.aclose()
    asyncio.run(main())


# an app mounted in the gateway's process (an in-process replica)

async def streaming_app(scope, receive, send):
    """Echoes the request (method, path, query, body, a header) in the head, then streams three chunks unless the
    client leaves; /boom raises before answering; /slow answers nothing; the disconnects it sees are recorded."""
    assert scope["type"] == "http"
    body = (await receive())["body"]
    if scope["path"] == "/boom":
        raise ValueError("the model failed")
    if scope["path"] == "/slow":  # answers nothing until the client has left
        streaming_app.slow_saw = await receive()
        return
    headers = dict(scope["headers"])
    await send({"type": "http.response.start", "status": 201, "headers": [
        (b"x-echo", b"|".join([scope["method"].encode(), scope["path"].encode(), scope["query_string"], body,
                               headers[b"x-tenant"]]))]})
    for i in range(3):
        await send({"type": "http.response.body", "body": f"part {i};".encode(), "more_body": True})
        await asyncio.sleep(0.01)
        if scope["path"] == "/leave" and i == 0:
            streaming_app.disconnect = await receive()
            return
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def test_a_mounted_app_is_called_in_process_and_its_body_streams():
    async def main():
        transport = UpstreamTransport()
        transport.mount("in-process-test", streaming_app)
        request = httpx.Request("POST", "http://in-process-test/v1/x?a=1", content=b"hello",
                                headers={"X-Tenant": "t1"})
        r = await transport.handle_async_request(request)
        assert r.status_code == 201 and r.headers["x-echo"] == "POST|/v1/x|a=1|hello|t1"
        parts = [chunk async for chunk in r.aiter_raw()]
        assert parts == [b"part 0;", b"part 1;", b"part 2;"]  # as the app sent them, not gathered
        await r.aclose()
        transport.unmount("in-process-test")
        with pytest.raises(httpx.ConnectError):  # unmounted: a host that does not resolve
            await send(transport, "http://in-process-test", connect=2.0)
        await transport.aclose()
    asyncio.run(main())


def test_a_mounted_apps_failure_is_an_error_and_a_left_response_is_a_disconnect(caplog):
    async def main():
        transport = UpstreamTransport()
        transport.mount("in-process-test", streaming_app)
        with pytest.raises(httpx.RemoteProtocolError, match="the model failed"):
            await transport.handle_async_request(httpx.Request("POST", "http://in-process-test/boom"))
        with pytest.raises(httpx.ReadTimeout):
            await transport.handle_async_request(httpx.Request(
                "GET", "http://in-process-test/slow", extensions={"timeout": {"read": 0.1}}))
        r = await transport.handle_async_request(httpx.Request("GET", "http://in-process-test/leave",
                                                               headers={"x-tenant": "t"}))
        async for _ in r.aiter_raw():
            break
        await r.aclose()  # the gateway's client went away
        for _ in range(100):
            if hasattr(streaming_app, "disconnect"):
                break
            await asyncio.sleep(0.01)
        assert streaming_app.disconnect == streaming_app.slow_saw == {"type": "http.disconnect"}
        await asyncio.sleep(0)  # a finished task's done callbacks run on the next turn
        assert not transport_module._AppCall.running  # no call is left behind
    asyncio.run(main())
    assert "in-process replica failed on POST /boom" in caplog.text
