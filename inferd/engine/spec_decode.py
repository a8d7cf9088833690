"""Speculative decoding: draft tokens proposed cheaply, verified by the model in one forward.

Drafts come from prompt lookup (the k tokens that followed the latest earlier occurrence of the sequence's
last n-gram) or from a draft model (engine/draft.py: a smaller model of the same tokenizer, or the target's
first layers). The model computes the last token and the k drafts in one forward; draft i is kept by the rule
that leaves the output distribution unchanged (Leviathan et al. 2023): with a greedy request, when it is the
argmax; with a sampled one, with probability min(1, p(draft) / q(draft)), where q is the draft's distribution
(a point mass, q = 1, for prompt lookup), and on the first rejection the token is drawn from
norm(max(0, p - q)). One more token (the "bonus") always comes from the model, so a step yields 1 to k + 1.
"""
from dataclasses import dataclass, field

import torch

from inferd.engine.block_manager import BlockManager
from inferd.engine.draft import DraftModel
from inferd.engine.scheduler import Batch, ScheduledSeq
from inferd.engine.sequence import Sequence


@dataclass(slots=True)
class SpecConfig:
    num_draft_tokens: int = 0  # k; 0 turns speculation off
    ngram_max: int = 3
    ngram_min: int = 1

    def __post_init__(self):
        if self.num_draft_tokens < 0 or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("num_draft_tokens must be >= 0 and 1 <= ngram_min <= ngram_max")


@dataclass(slots=True)
class SpecStats:
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafted_by_position: list[int] = field(default_factory=list)  # drafts proposed at position 1, 2, ...
    accepted_by_position: list[int] = field(default_factory=list)  # drafts accepted at position 1, 2, ...


class Speculator:
    """Adds drafts to a scheduled batch, then turns verified logits into the kept tokens."""

    def __init__(self, config: SpecConfig, blocks: BlockManager, max_model_len: int,
                 draft_model: DraftModel | None = None):
        self.config = config
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.draft_model = draft_model  # None: prompt lookup
        k = config.num_draft_tokens
        self.stats = SpecStats(drafted_by_position=[0] * k, accepted_by_position=[0] * k)
        self.draft_probs: dict[Sequence, torch.Tensor] = {}  # this step's q rows of sampled draft-model drafts

    def draft(self, batch: Batch) -> None:
        """Decodes with drafts become chunks of 1 + k tokens (their drafts appended to token_ids until verified).
        A draft model also computes this step's prompt chunks."""
        self.draft_probs.clear()
        chosen, keep = [], []
        for item in batch.decodes:
            k = self._num_drafts(item.seq)
            if k and self.draft_model is None:
                item.draft = propose(item.seq.token_ids, k, self.config.ngram_max, self.config.ngram_min)
                k = len(item.draft)
            end = item.seq.num_computed_tokens + 1 + k
            if k and self.blocks.can_allocate(item.seq, end):
                self.blocks.allocate(item.seq, end)
                chosen.append((item, k))
            else:
                item.draft = None
                keep.append(item)
        if self.draft_model is not None:
            seqs, ks = [item.seq for item, _ in chosen], [k for _, k in chosen]
            drafts, qs = self.draft_model.propose(seqs, ks, batch.prefills)
            for (item, _), draft, q in zip(chosen, drafts, qs):
                item.draft = draft
                if q is not None:
                    self.draft_probs[item.seq] = q
        for item, _ in chosen:
            item.seq.token_ids.extend(item.draft)
            item.num_tokens = 1 + len(item.draft)
            batch.prefills.append(item)
        batch.decodes = keep

    def _num_drafts(self, seq: Sequence) -> int:
        p = seq.params
        if p.logprobs or p.presence_penalty or p.frequency_penalty or getattr(seq, "grammar", None) is not None:
            return 0
        room = min(p.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq)) - 1  # the bonus token
        return max(0, min(self.config.num_draft_tokens, room))

    def verify(self, item: ScheduledSeq, logits: torch.Tensor, probs) -> list[int]:
        """Rolls the drafts back out of the sequence and returns the tokens to append (1 to k + 1)."""
        seq, draft = item.seq, item.draft
        del seq.token_ids[len(seq.token_ids) - len(draft):]
        kept = accept_greedy(logits, draft) if seq.params.greedy else accept_sampled(
            probs(logits, seq), draft, seq.generator, self.draft_probs.pop(seq, None))
        accepted = len(kept) - 1
        seq.num_computed_tokens += 1 + accepted  # KV of the last token and of the accepted drafts is right
        if self.draft_model is not None:
            self.draft_model.roll_back(seq)
        self.stats.draft_tokens += len(draft)
        self.stats.accepted_tokens += accepted
        for i in range(len(draft)):
            self.stats.drafted_by_position[i] += 1
            self.stats.accepted_by_position[i] += int(i < accepted)
        return kept


def propose(tokens: list[int], k: int, ngram_max: int, ngram_min: int, search_window: int = 4096) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n-gram (longest n first)."""
    window = tokens[-search_window:]
    for n in range(min(ngram_max, len(window) - 1), ngram_min - 1, -1):
        suffix = window[-n:]
        for start in range(len(window) - n - 1, -1, -1):
            if window[start:start + n] == suffix:
                return window[start + n:start + n + k]
    return []


def accept_greedy(logits: torch.Tensor, draft: list[int]) -> list[int]:
    """logits: (k + 1, vocab) for the positions of the last token and each draft. Returns the kept tokens."""
    best = logits.argmax(dim=-1).tolist()
    kept = 0
    while kept < len(draft) and best[kept] == draft[kept]:
        kept += 1
    return draft[:kept] + [best[kept]]


def accept_sampled(probs: torch.Tensor, draft: list[int], generator: torch.Generator | None,
                   draft_probs: torch.Tensor | None = None) -> list[int]:
    """probs: (k + 1, vocab), the request's sampling distribution at each position (temperature, top-k/p);
    draft_probs: (k, vocab), the distribution q each draft was drawn from; None for point masses (q = 1)."""
    uniforms = torch.rand(len(draft), generator=generator).tolist()
    for i, token in enumerate(draft):
        q = 1.0 if draft_probs is None else draft_probs[i, token].item()
        if uniforms[i] * q < probs[i, token].item():  # u < p / q
            continue
        if draft_probs is None:
            residual = probs[i].clone()
            residual[token] = 0.0
        else:
            residual = (probs[i] - draft_probs[i]).clamp_(min=0.0)
        return draft[:i] + [_draw(residual, generator)]
    return draft + [_draw(probs[len(draft)], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    if weights.sum() <= 0:
        return int(weights.argmax())
    return int(torch.multinomial(weights, 1, generator=generator))
