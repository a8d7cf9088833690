"""A replica inside the gateway's process (placement.backend: in_process): the cheap kinds without a second hop.

A classical model or a robot policy answers in about the time a replica process in front of it adds to each
request: a loopback HTTP round trip, a second HTTP parser and a second process's share of the cores.
Here the replica's own app (the same Starlette app `inferd replica` serves) is mounted on the gateway's
upstream transport under its URL's host, and runs on the gateway's event loop: the gateway's request path,
its keys, limits, admission and usage records are the same as for a remote replica, and the data path still
imports no replica code. The price is isolation: the model shares the gateway's process, its GIL and its
CPUs, and a crash in its library takes the gateway with it. Whether it pays depends on the machine and the
load: a request saves the hop, but the model's Python and the gateway's then take turns on one GIL where two
processes would run side by side (benchmarks/README.md measures both); so it is a deployment's choice
(`placement: {backend: in_process}`), not the default.

Life: start() loads the model and mounts the app (any thread); serve() runs the app's lifespan on the
gateway's loop and returns once its /ready says it ran a real inference; stop() ends the lifespan (from a
thread, as the pool calls it) and unmounts the app.
"""
import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from inferd.control.kinds import Settings
from inferd.gateway.transport import ASGIApp, UpstreamTransport

log = logging.getLogger(__name__)

KINDS = ("classical", "policy")  # the kinds a replica may run in the gateway's process
STOP_TIMEOUT_S = 15.0


def _loader(kind: str) -> Callable[..., ASGIApp]:
    if kind == "classical":
        from inferd.classical.server import load_classical_app
        return load_classical_app
    if kind == "policy":
        from inferd.policy.server import load_policy_app
        return load_policy_app
    raise ValueError(f"a {kind} replica does not run in the gateway's process (only {', '.join(KINDS)})")


@dataclass(slots=True, eq=False)
class InProcessReplica:
    kind: str
    source: str | None  # the model (None or "default": the kind's packaged one)
    served_model_name: str
    settings: Settings
    transport: UpstreamTransport  # the gateway's: its requests reach the app through it
    host: str = field(default_factory=lambda: f"in-process-{secrets.token_hex(4)}")  # never a real host name
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    app: ASGIApp | None = None
    _started_s: float = 0.0
    _loaded_s: float = 0.0
    _loop: asyncio.AbstractEventLoop | None = None
    _life: "Lifespan | None" = None

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def start(self) -> None:
        self._started_s = time.time()
        load = _loader(self.kind)
        source = None if self.source in (None, "default") else self.source
        self.app = load(source, self.api_key, self.served_model_name, self.settings)
        self._loaded_s = time.time()
        self.transport.mount(self.host, self.app)
        log.info("%s %s loaded in the gateway's process (%.1f s)", self.kind, self.served_model_name,
                 self._loaded_s - self._started_s)

    def card(self) -> dict:
        """Its /v1/models card, read from the app (no request: this works before the gateway's loop runs)."""
        return self.app.state.card()

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        """Loaded is all there is to wait for outside the gateway's loop: serve() runs the readiness inference."""
        if self.app is None:
            raise RuntimeError(f"in-process replica {self.served_model_name} was not started")

    async def serve(self, timeout_s: float = 900.0) -> None:
        """On the gateway's loop: the app's lifespan started, then until its /ready answers 200 (a real
        inference ran); raises if the start-up fails or takes longer than timeout_s."""
        self._loop = asyncio.get_running_loop()
        self._life = Lifespan(self.app)
        await self._life.startup()
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(transport=self.transport, timeout=5.0) as client:
            while time.monotonic() < deadline:
                if (await client.get(f"{self.url}/ready")).status_code == 200:
                    return
                await asyncio.sleep(0.05)
        raise RuntimeError(f"in-process replica {self.served_model_name} not ready after {timeout_s:.0f} s")

    def alive(self) -> bool:
        return self.app is not None and (self._life is None or not self._life.ended)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Its lifespan ended (the batcher stopped) and its app unmounted; from any thread but the loop's."""
        self.transport.unmount(self.host)
        self.app, life, self._life = None, self._life, None
        if life is None or self._loop is None or self._loop.is_closed():
            return
        try:
            if asyncio.get_running_loop() is self._loop:  # on the loop itself: it ends once the loop gets to it
                asyncio.create_task(life.shutdown())
                return
        except RuntimeError:  # no loop runs in this thread
            pass
        try:
            asyncio.run_coroutine_threadsafe(life.shutdown(), self._loop).result(timeout_s)
        except Exception as exc:  # a loop that ended meanwhile, or a shutdown that raised: nothing more to stop
            log.warning("in-process replica %s: its shutdown did not complete (%s)", self.served_model_name, exc)

    def cold_start(self) -> dict:
        """The phases the pool reports (as a process replica's /ready gives them)."""
        return {"loaded_unix_s": self._loaded_s}


class Lifespan:
    """An ASGI app's lifespan protocol, driven as a server drives it: startup, then shutdown."""

    def __init__(self, app: ASGIApp):
        self._app = app
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._replies: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.ended = False

    async def startup(self) -> None:
        self._task = asyncio.create_task(self._run())
        await self._step("lifespan.startup")

    async def shutdown(self) -> None:
        if self._task is not None and not self.ended:
            await self._step("lifespan.shutdown")
            await self._task

    async def _run(self) -> None:
        try:
            await self._app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                            self._inbox.get, self._replies.put)
        except Exception as exc:
            await self._replies.put({"type": "lifespan.failed", "message": repr(exc)})
        finally:
            self.ended = True

    async def _step(self, what: str) -> None:
        await self._inbox.put({"type": what})
        reply = await self._replies.get()
        if reply["type"] != f"{what}.complete":
            raise RuntimeError(f"the in-process replica's {what} failed: {reply.get('message', '')}")
