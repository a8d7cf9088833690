import time
from collections import Counter, deque
from dataclasses import dataclass

from inferd.engine.block_manager import BlockManager
from inferd.engine.config import EngineConfig
from inferd.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step
    draft: list[int] | None = None  # speculative tokens at the end of those (verified by this step's logits)

    @property
    def reaches_end(self) -> bool:
        """True when this step computes the sequence's last token."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq)

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token and it wants a new one (max_tokens > 0)."""
        return self.reaches_end and self.seq.params.max_tokens > 0

    @property
    def num_prompt_logprobs(self) -> int:
        """Prompt logprobs this step's logits give: position p's logits score prompt token p + 1, for the
        positions computed now whose next prompt token has none yet (a recomputed preempted sequence has some)."""
        seq = self.seq
        if not seq.params.prompt_logprobs:
            return 0
        start = max(seq.num_computed_tokens, len(seq.prompt_logprobs))
        return max(0, min(seq.num_computed_tokens + self.num_tokens, seq.num_prompt_tokens - 1) - start)

    @property
    def num_logits(self) -> int:
        """Logits rows this step asks for, always the chunk's last ones: its prompt logprobs', then 1 + k to
        verify k drafts, or 1 to sample. A prompt-only request (max_tokens 0) also gets its last position's row,
        unused (it scores no prompt token), so that its prompt rows end the chunk too."""
        wants = 1 + len(self.draft) if self.draft else int(self.samples)
        unused = int(self.reaches_end and not self.samples and self.num_prompt_logprobs > 0)
        return self.num_prompt_logprobs + wants + unused


@dataclass(slots=True)
class Batch:
    decodes: list[ScheduledSeq]  # one token each, listed first
    prefills: list[ScheduledSeq]  # a chunk of the prompt (or of a preempted sequence) each

    @property
    def seqs(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.decodes) + sum(s.num_tokens for s in self.prefills)


class Scheduler:
    """Continuous batching under a token budget: decodes first, then prompt chunks in rank order.

    A sequence's rank (priority policy): its class, then how many sequences of its cache namespace (its
    tenant) are running, then its arrival; so a tenant's new prompt is not computed behind the chunks of a
    tenant that already runs many, and a lower class never passes a higher one. FCFS ranks by arrival alone.
    A step that prefills a higher class computes no prompt chunk of a lower one, so it stays short.

    When the KV pool runs out, the worst-ranked running sequence is preempted: its blocks are freed and it is
    recomputed later from its tokens, starting at whatever of them is still in the prefix cache.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.by_priority = config.scheduling_policy == "priority"
        self.lower_class_seqs = config.lower_class_seqs
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()  # in rank order once schedule() has begun
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self._load: Counter[str] = Counter()  # running sequences per cache namespace, as this step began

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _rank(self, seq: Sequence) -> tuple[int, int, float]:
        if not self.by_priority:
            return 0, 0, seq.arrival_time  # a preempted sequence arrived before those that came after it
        return seq.priority, self._load[seq.cache_namespace], seq.arrival_time

    def schedule(self) -> Batch:
        batch = Batch([], [])
        self._load = Counter(s.cache_namespace for s in self.running)
        self.waiting = deque(sorted(self.waiting, key=self._rank))
        self._make_room_for_next()
        budget, preempted, chunks = self._schedule_decodes(batch, self.max_num_batched_tokens)
        self._schedule_prefills(batch, budget, chunks, admit=not preempted)
        return batch

    def _schedule_decodes(self, batch: Batch, budget: int) -> tuple[int, bool, list[Sequence]]:
        """Steps the running sequences that decode (preempting the worst-ranked when blocks run out); returns
        the budget left, whether any was preempted, and the running sequences that have prompt left."""
        queue = deque(sorted(self.running, key=self._rank))  # preemption takes from the end
        held = self._held_back(queue)
        kept, chunks, preempted = deque(held), [], False
        while queue and budget > 0:
            seq = queue.popleft()
            kept.append(seq)
            if seq.num_uncomputed_tokens > 1:
                chunks.append(seq)
                continue
            while not self.blocks.can_allocate(seq, seq.num_computed_tokens + 1):
                preempted = True
                victim = queue.pop() if queue else kept.pop()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.allocate(seq, seq.num_computed_tokens + 1)
                batch.decodes.append(ScheduledSeq(seq, 1))
                budget -= 1
        kept.extend(queue)  # over budget this step, still running
        self.running = deque(sorted(kept, key=lambda s: s.arrival_time))
        return budget, preempted, chunks

    def _schedule_prefills(self, batch: Batch, budget: int, chunks: list[Sequence], admit: bool) -> None:
        """Prompt chunks of running sequences and new waiting ones, best rank first, until the budget is spent;
        once a class is prefilled, worse classes wait for a later step. admit: waiting ones may start."""
        chunks = deque(sorted(chunks, key=self._rank))
        prefilled = None  # the class prefilled in this step
        while budget > 0 and (chunks or (admit and self.waiting)):
            from_waiting = admit and self.waiting and (
                not chunks or self._rank(self.waiting[0]) < self._rank(chunks[0]))
            seq = self.waiting[0] if from_waiting else chunks[0]
            if self.by_priority and prefilled is not None and seq.priority > prefilled:
                return
            if from_waiting:
                n = self._admit(batch, budget)
                if n is None:
                    admit = False
                    continue
            else:
                chunks.popleft()
                n = min(seq.num_uncomputed_tokens, budget)
                while not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                    admit, victim = False, chunks.pop() if chunks else seq
                    self.running.remove(victim)
                    self._preempt(victim)
                    if victim is seq:
                        break
                else:
                    self.blocks.allocate(seq, seq.num_computed_tokens + n)
                    batch.prefills.append(ScheduledSeq(seq, n))
                if seq.status != Status.RUNNING:
                    continue
            prefilled, budget = seq.priority, budget - n

    def join(self, budget: int, best: int) -> Batch:
        """A batch of waiting sequences to prefill inside a step in flight (between its layers), best rank first:
        admitted as schedule() admits them, within `budget` tokens and without preempting; none of a class worse
        than best (the step's), nor one with a grammar (its mask needs a step's worker of its own)."""
        self.waiting = deque(sorted(self.waiting, key=self._rank))
        joined = Batch([], [])
        while budget > 0 and self.waiting:
            seq = self.waiting[0]
            if seq.grammar is not None or (self.by_priority and seq.priority > best):
                break
            n = self._admit(joined, budget)
            if n is None:
                break
            budget -= n
        return joined

    def _held_back(self, queue: deque[Sequence]) -> list[Sequence]:
        """Priority policy: while the best class present has work, only lower_class_seqs sequences of lower
        classes are stepped (the best-ranked first); the rest leave the queue for this step, keeping their blocks."""
        best = self._best_class()
        if best is None:
            return []
        lower = [s for s in queue if s.priority > best]
        held = lower[self.lower_class_seqs:]
        for seq in held:
            queue.remove(seq)
        return held

    def _best_class(self) -> int | None:
        """The best class with work while a worse one runs too (None: one class only, or FCFS)."""
        if not self.by_priority or not self.running:
            return None
        classes = {s.priority for s in self.running} | ({self.waiting[0].priority} if self.waiting else set())
        return min(classes) if len(classes) > 1 else None

    def _admit(self, batch: Batch, budget: int) -> int | None:
        """Starts the first waiting sequence at its longest cached prefix (the rest of it is computed in prompt
        chunks); the tokens it computes in this step, or None if it cannot start now."""
        seq = self.waiting[0]
        if len(self.running) >= self.max_num_seqs:
            return None
        best = self._best_class()
        if best is not None and seq.priority > best and sum(
                s.priority > best for s in self.running) >= self.lower_class_seqs:
            return None  # it would only be held back
        prefix = self._reusable_prefix(seq)
        start = len(prefix) * self.blocks.block_size
        n = min(len(seq) - start, budget)
        if not self.blocks.can_admit(seq, start + n, prefix):
            return None
        self.waiting.popleft()
        self.blocks.admit(seq, start + n, prefix)
        seq.num_computed_tokens = start
        seq.status = Status.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
            seq.num_cached_tokens = start
        self.running.append(seq)
        batch.prefills.append(ScheduledSeq(seq, n))
        return n

    def _reusable_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks seq may start on: none when it asks for prompt logprobs, which need every position's
        logits computed."""
        return [] if seq.params.prompt_logprobs else self.blocks.cached_prefix(seq)

    def _make_room_for_next(self) -> None:
        """Priority policy: the next waiting sequence gets a slot and its blocks from running sequences of lower
        classes (the newest of the lowest first), preempted before this step schedules any of them: when all
        max_num_seqs slots are taken, and when the KV pool cannot hold it."""
        if not (self.by_priority and self.waiting):
            return
        seq = self.waiting[0]
        while len(self.running) >= self.max_num_seqs:
            if not self._preempt_lower_than(seq):
                return
        prefix = self._reusable_prefix(seq)
        start = len(prefix) * self.blocks.block_size
        need = start + min(len(seq) - start, self.max_num_batched_tokens)
        while not self.blocks.can_admit(seq, need, prefix):
            if not self._preempt_lower_than(seq):
                return

    def _preempt_lower_than(self, seq: Sequence) -> bool:
        lower = [r for r in self.running if r.priority > seq.priority]
        if not lower:
            return False
        victim = max(lower, key=lambda r: (r.priority, r.arrival_time))
        self.running.remove(victim)
        self._preempt(victim)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        rank = self._rank(seq)
        at = next((i for i, w in enumerate(self.waiting) if rank < self._rank(w)), len(self.waiting))
        self.waiting.insert(at, seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence wherever it is and gives its blocks back at once."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
