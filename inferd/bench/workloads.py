from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from inferd.bench.errors import WorkloadError
from inferd.bench.tokenizer import PromptCounter
from inferd.bench.trace import TraceEntry, read_trace

WorkloadKind = Literal["synthetic", "shared-prefix", "trace"]
MAX_FIT_ROUNDS = 20


@dataclass(slots=True)
class BenchRequest:
    """One request to send: text is the user message (chat) or the prompt (completions)."""
    index: int
    text: str
    input_tokens: int  # as the server will count them
    max_tokens: int
    arrival_offset_s: float | None = None  # trace replay only
    cancel_after_chunks: int | None = None
    document: int | None = None  # shared-prefix only
    messages: list[dict] | None = None  # quality set: the item's chat messages (sent greedy, stops at EOS)
    check: Callable[[str], bool] | None = None  # quality set: whether a reply passes the item's check


@dataclass(slots=True)
class WorkloadConfig:
    kind: WorkloadKind = "synthetic"
    input_tokens: int = 256
    output_tokens: int = 64
    num_documents: int = 4
    document_tokens: int = 512
    questions_per_document: int = 4
    question_tokens: int = 16
    trace_path: Path | None = None
    cancel_fraction: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.cancel_fraction <= 1.0:
            raise WorkloadError(f"--cancel-fraction must be between 0 and 1 (got {self.cancel_fraction})")
        if self.output_tokens < 1:
            raise WorkloadError(f"--output-tokens must be at least 1 (got {self.output_tokens})")


# text of an exact token length

class TextMaker:
    """Random words, fitted until the server-side prompt length is exactly the target."""

    def __init__(self, counter: PromptCounter, pool: list[str], seed: int):
        self.counter = counter
        self.pool = pool
        self.rng = np.random.default_rng(seed)
        self.overhead = counter.count("")

    def words(self, count: int) -> list[str]:
        return [self.pool[i] for i in self.rng.integers(0, len(self.pool), size=count)]

    def exact(self, num_tokens: int) -> str:
        """A prompt the server counts as num_tokens tokens."""
        if num_tokens <= self.overhead:
            raise WorkloadError(f"an input of {num_tokens} tokens leaves no room for text: the prompt format "
                                f"alone takes {self.overhead} tokens; raise --input-tokens")
        return self._fit(num_tokens, self.counter.count, num_tokens - self.overhead)

    def exact_plain(self, num_tokens: int) -> str:
        """Text of num_tokens tokens on its own (no template, no BOS): a document."""
        tokenizer = self.counter.tokenizer
        return self._fit(num_tokens, lambda t: len(tokenizer.encode(t, add_special_tokens=False)), num_tokens)

    def _fit(self, num_tokens: int, count: Callable[[str], int], first_guess: int) -> str:
        words = self.words(first_guess)
        for _ in range(MAX_FIT_ROUNDS):
            missing = num_tokens - count(_join(words))
            if missing == 0:
                return _join(words)
            words = words + self.words(missing) if missing > 0 else words[:missing]
        raise WorkloadError(f"could not fit a text of exactly {num_tokens} tokens; use another tokenizer")


def _join(words: list[str]) -> str:
    return "".join(words).lstrip()


# workloads

def build_requests(config: WorkloadConfig, counter: PromptCounter, pool: list[str], count: int) -> list[BenchRequest]:
    """count requests (fewer when a trace or the document set is shorter), cancellers marked."""
    maker = TextMaker(counter, pool, config.seed)
    if config.kind == "synthetic":
        requests = [BenchRequest(i, maker.exact(config.input_tokens), config.input_tokens, config.output_tokens)
                    for i in range(count)]
    elif config.kind == "shared-prefix":
        requests = shared_prefix(config, maker, count)
    else:
        requests = replay(read_trace(_trace_path(config)), maker, count)
    mark_cancellers(requests, config.cancel_fraction, config.seed)
    return requests


def shared_prefix(config: WorkloadConfig, maker: TextMaker, count: int) -> list[BenchRequest]:
    """K documents of L tokens, each asked M questions; arrivals interleave documents round-robin."""
    docs = [maker.exact_plain(config.document_tokens) for _ in range(config.num_documents)]
    requests = []
    for q in range(config.questions_per_document):
        for d, doc in enumerate(docs):
            text = f"{doc}\n\nQuestion {q + 1}: {_join(maker.words(config.question_tokens))}?"
            requests.append(BenchRequest(len(requests), text, maker.counter.count(text), config.output_tokens,
                                         document=d))
    return requests[:count]


def replay(entries: list[TraceEntry], maker: TextMaker, count: int) -> list[BenchRequest]:
    requests = []
    for i, e in enumerate(entries[:count]):
        text = e.text if e.text is not None else maker.exact(e.input_tokens or 0)
        requests.append(BenchRequest(i, text, maker.counter.count(text), e.output_tokens, e.arrival_offset_s))
    return requests


def quality_requests(set_path: Path, split: str, counter: PromptCounter, count: int | None) -> list[BenchRequest]:
    """The set's items in file order (repeated up to count; None: each once), as its prompt template writes
    them, with the template's max_tokens and each item's check of the reply (inferd.eval.scoring)."""
    from inferd.eval.docset import SetError, load_set
    from inferd.eval.scoring import score
    try:
        evalset = load_set(set_path)
        items = evalset.split(split)
    except SetError as exc:
        raise WorkloadError(f"--quality-set: {exc}") from None
    t, requests = evalset.template, []
    for i in range(len(items) if count is None else count):
        item, messages = items[i % len(items)], t.messages(items[i % len(items)])
        text = "\n\n".join(m["content"] for m in messages)  # counted as one message: the server's usage corrects it
        requests.append(BenchRequest(i, text, counter.count(text), t.max_tokens, messages=messages,
                                     check=lambda reply, item=item: score(item, reply, t.cite).passed))
    return requests


def mark_cancellers(requests: list[BenchRequest], fraction: float, seed: int) -> None:
    """round(fraction × n) requests, chosen by seed, close their stream after half their output."""
    rng = np.random.default_rng(seed + 1)
    chosen = rng.choice(len(requests), size=round(fraction * len(requests)), replace=False)
    for i in chosen.tolist():
        requests[i].cancel_after_chunks = max(1, requests[i].max_tokens // 2)


def _trace_path(config: WorkloadConfig) -> Path:
    if config.trace_path is None:
        raise WorkloadError("--workload trace needs --trace FILE.jsonl")
    return config.trace_path
