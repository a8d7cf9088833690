"""A fast fake OpenAI-compatible upstream: canned replies, no model, no sleeps.

Raw asyncio HTTP/1.1 (keep-alive, pipelining) on the stdlib only, so that in
benchmarks/gateway.py the upstream costs far less per request than any gateway
in front of it.

    python benchmarks/fake_upstream.py --port 9000

POST /v1/chat/completions, POST /v1/completions: a fixed 8-token reply with
usage; with "stream": true, SSE: one chunk per token, then a usage chunk when
stream_options.include_usage, then `data: [DONE]`, as one chunked response.
GET /v1/models, GET /health. The /v1 prefix is optional.
"""
import argparse
import asyncio
import json
import socket

REPLY_TOKENS = ["Hello", " from", " the", " fake", " upstream", ",", " friend", "."]
PROMPT_TOKENS = 16
CREATED = 1700000000
MAX_HEADER_BYTES = 64 * 1024


def _usage() -> dict:
    n = len(REPLY_TOKENS)
    return {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n, "total_tokens": PROMPT_TOKENS + n}


def _head(status: str, content_type: str, length: int | None) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n{framing}\r\n\r\n".encode()


def json_response(obj: dict, status: str = "200 OK") -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return _head(status, "application/json", len(body)) + body


def sse_response(events: list[dict]) -> bytes:
    parts = [_head("200 OK", "text/event-stream", None)]
    lines = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events]
    for line in lines + [b"data: [DONE]\n\n"]:
        parts.append(b"%x\r\n%s\r\n" % (len(line), line))
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


# ---- canned bodies, built once per (kind, model, stream, include_usage)

def chat_body(model: str, stream: bool, include_usage: bool) -> bytes:
    base = {"id": "chatcmpl-fake", "created": CREATED, "model": model}
    if not stream:
        message = {"role": "assistant", "content": "".join(REPLY_TOKENS)}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
        return json_response(base | {"object": "chat.completion", "choices": [choice], "usage": _usage()})
    base["object"] = "chat.completion.chunk"
    events = []
    for i, tok in enumerate(REPLY_TOKENS):
        delta = {"role": "assistant", "content": tok} if i == 0 else {"content": tok}
        last = i == len(REPLY_TOKENS) - 1
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": "stop" if last else None}
        events.append(base | {"choices": [choice]})
    if include_usage:
        events.append(base | {"choices": [], "usage": _usage()})
    return sse_response(events)


def completion_body(model: str, stream: bool, include_usage: bool) -> bytes:
    base = {"id": "cmpl-fake", "object": "text_completion", "created": CREATED, "model": model}
    if not stream:
        choice = {"index": 0, "text": "".join(REPLY_TOKENS), "logprobs": None, "finish_reason": "stop"}
        return json_response(base | {"choices": [choice], "usage": _usage()})
    events = []
    for i, tok in enumerate(REPLY_TOKENS):
        last = i == len(REPLY_TOKENS) - 1
        events.append(base | {"choices": [{"index": 0, "text": tok, "logprobs": None,
                                           "finish_reason": "stop" if last else None}]})
    if include_usage:
        events.append(base | {"choices": [], "usage": _usage()})
    return sse_response(events)


GENERATORS = {"/chat/completions": chat_body, "/completions": completion_body}
HEALTH = json_response({"status": "ok"})
NOT_FOUND = json_response({"error": {"message": "not found", "type": "invalid_request_error"}}, "404 Not Found")


def bad_request(message: str) -> bytes:
    return json_response({"error": {"message": message, "type": "invalid_request_error"}}, "400 Bad Request")


class Responder:
    def __init__(self, model: str):
        self.model = model
        self.cache: dict[tuple, bytes] = {}
        self.models = json_response({"object": "list", "data": [
            {"id": model, "object": "model", "created": CREATED, "owned_by": "fake-upstream"}]})

    def respond(self, method: str, path: str, body: bytes) -> bytes:
        path = path.split("?", 1)[0]
        if path.startswith("/v1/"):
            path = path[3:]
        if method == "GET":
            return HEALTH if path == "/health" else self.models if path == "/models" else NOT_FOUND
        make = GENERATORS.get(path)
        if method != "POST" or make is None:
            return NOT_FOUND
        try:
            req = json.loads(body)
        except ValueError:
            return bad_request("body is not JSON")
        stream = bool(req.get("stream"))
        include_usage = stream and bool((req.get("stream_options") or {}).get("include_usage"))
        key = (path, str(req.get("model") or self.model), stream, include_usage)
        out = self.cache.get(key)
        if out is None:
            out = self.cache[key] = make(key[1], stream, include_usage)
        return out


class HTTPProtocol(asyncio.Protocol):
    """HTTP/1.1 server side: Content-Length bodies, keep-alive, pipelined requests."""

    def __init__(self, responder: Responder):
        self.responder = responder
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport):
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes):
        self.buf += data
        out = []
        close = False
        while not close:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEADER_BYTES:
                    out.append(bad_request("headers too large"))
                    close = True
                break
            method, path, length, close, error = parse_head(self.buf[:end])
            if error:
                out.append(bad_request(error))
                close = True
                break
            if len(self.buf) < end + 4 + length:
                close = False
                break
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            out.append(self.responder.respond(method, path, body))
        if out:
            self.transport.write(b"".join(out))
        if close:
            self.transport.close()


def parse_head(raw: bytes) -> tuple[str, str, int, bool, str]:
    """(method, path, content length, connection: close, error) of one request head."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return "", "", 0, True, "malformed request line"
    length, close = 0, False
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "connection":
            close = value.strip().lower() == "close"
        elif name == "transfer-encoding":
            return "", "", 0, True, "chunked request bodies are not supported"
    return parts[0], parts[1], length, close, ""


async def serve(host: str, port: int, model: str) -> None:
    responder = Responder(model)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: HTTPProtocol(responder), host, port, backlog=4096, reuse_address=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--model", default="fake-model", help="the id /v1/models lists (replies echo the request's model)")
    args = ap.parse_args()
    try:
        asyncio.run(serve(args.host, args.port, args.model))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
