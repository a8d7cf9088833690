"""The engine loop in its own thread, beside an asyncio server.

Requests and aborts cross into the thread through one queue as typed messages;
each step's outputs cross back with one call_soon_threadsafe. The loop sleeps
while idle. A request of a better class than all of a running step's sequences
(interactive beside batch work) stops that step between layers, so that it is
scheduled in the next one instead of waiting out a long batch step; one of the
same class is taken between the step's layers and prefilled in a step of its
own right there (LLMEngine.step's arrivals), so that its first token waits for
no other request's step. Other messages that arrive mid-step wait for its end.
"""
import asyncio
import logging
import math
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import llguidance

from inferd.engine.engine import Arrivals, LLMEngine
from inferd.engine.spec_decode import SpecStats
from inferd.engine.request import EngineDeadError, EngineError, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_evictions: int
    spec: SpecStats | None = None  # speculative decoding, when on
    num_nested_prefills: int = 0  # prompts prefilled inside a step in flight (LLMEngine.step's arrivals)
    threads: int = 1  # a step's threads now (LLMEngine.cores)
    others_cores: float = 0.0  # cores of this process's set that other processes used in the last window
    num_thread_changes: int = 0


# inbox messages: event loop -> engine thread

@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_namespace: str
    grammar: llguidance.LLMatcher | None  # compiled off the engine thread
    priority: int


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class Wake:
    """Nothing to do: the loop wakes and sees that it is stopping."""


InboxMessage = AddRequest | AbortRequest | Wake


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        # the best class added since the engine thread last took its inbox (written by both threads without a
        # lock: a race costs one step's wait for a request, or one spurious check, never a wrong answer)
        self._arrived = math.inf
        self._added = False  # an AddRequest was put since the engine thread last looked (same race rule)
        self._deferred: list[InboxMessage] = []  # taken mid-step, handled once the step is over
        self._arrivals = Arrivals(self._take_arrivals, self._deliver)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """The context a request may use here: the model's, or the KV pool's if smaller."""
        return self.engine.context_limit

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def healthy(self) -> bool:
        """False once the engine loop has died."""
        return self._error is None and (self._thread is None or self._thread.is_alive() or self._stopping.is_set())

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="inferd-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(Wake())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def stats(self) -> EngineStats:
        e, s, b = self.engine, self.engine.scheduler, self.engine.blocks
        return EngineStats(len(s.running), len(s.waiting), b.num_used_blocks, b.num_blocks, s.num_preemptions,
                           b.num_query_tokens, b.num_hit_tokens, b.num_evictions,
                           e.speculator.stats if e.speculator else None, e.num_nested_prefills,
                           e.cores.current, e.cores.others_cores, e.cores.num_changes)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_namespace: str = "default", priority: int = 0) -> AsyncIterator[RequestOutput]:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error}")
        self.engine.check_request(len(prompt_token_ids), params)
        grammar = None
        if params.response_format is not None:  # compiled here, in a worker thread: never stalls the engine loop
            grammar = await asyncio.to_thread(self.engine.grammars.matcher, params.response_format)
        if request_id in self._streams:
            raise EngineError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._arrived = min(self._arrived, priority)
        self._inbox.put(AddRequest(request_id, prompt_token_ids, params, cache_namespace, grammar, priority))
        self._added = True
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(AbortRequest(request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(AbortRequest(request_id))

    # ---- engine thread

    def _run(self) -> None:
        try:
            self.engine.grammars.warm()  # before the first step, so that no batch waits for it
            while not self._stopping.is_set():
                self._arrived = math.inf  # before the inbox is taken: an arrival after this is seen by the step
                self._drain_inbox(block=not self.engine.has_work())
                if self.engine.has_work():
                    self._deliver(self.engine.step(self._outranked, self._arrivals))
        except BaseException as e:  # the engine is broken: fail every open request, say why once
            log.exception("engine loop died")
            self._error = e
            self._loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"the engine stopped: {e}"))

    def _outranked(self, priority: int) -> bool:
        """Whether a request of a better class than priority was added since the inbox was last taken."""
        return self._arrived < priority

    def _take_arrivals(self) -> bool:
        """Mid-step (between layers): adds the requests put since, keeps any other message for after the step;
        True if a request was added."""
        if not self._added:
            return False
        self._added, added = False, False
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return added
            if isinstance(message, AddRequest):
                added = self._add(message) or added
            else:
                self._deferred.append(message)

    def _drain_inbox(self, block: bool) -> None:
        deferred, self._deferred = self._deferred, []
        self._added = False
        outputs = [out for message in deferred for out in self._handle(message)]
        try:
            message = self._inbox.get(timeout=0.5) if block and not deferred else self._inbox.get_nowait()
        except queue.Empty:
            message = None
        while message is not None:
            outputs += self._handle(message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                message = None
        self._deliver(outputs)

    def _handle(self, message: InboxMessage) -> list[RequestOutput]:
        match message:
            case AddRequest():
                self._add(message)
                return []
            case AbortRequest():
                out = self.engine.abort(message.request_id)
                return [out] if out else []
            case Wake():
                return []

    def _add(self, message: AddRequest) -> bool:
        try:
            self.engine.add_request(message.request_id, message.prompt_token_ids, message.params,
                                    message.cache_namespace, message.grammar, message.priority)
            return True
        except EngineError as e:
            self._loop.call_soon_threadsafe(self._put, message.request_id, e)
            return False

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    # ---- event loop side

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._put(out.request_id, out)

    def _put(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(item)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)
