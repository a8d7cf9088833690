"""Draft models for speculative decoding: a smaller model of the target's tokenizer, or the target's first layers.

Each step the draft proposes k tokens for every decoding sequence that speculates, one batched forward per
token: the first forward also computes what the draft has not seen of the sequence yet; the k - 1 others are
single-token decodes. A greedy request gets the draft's argmax; a sampled one a token drawn from the draft's
distribution q (the request's temperature, top-k and top-p applied), kept so the target's rejection rule uses
the real q.

A separate draft model keeps its own KV cache laid out like the target's (same number of blocks, same block
size), so the target's block tables index it too and no second block manager is needed: the blocks the target
allocates for the 1 + k tokens it verifies also hold the draft's KV of them. The draft computes every prompt
chunk the target computes, in the same step, so blocks that the prefix cache shares hold the draft's KV as well
(not always so for generated tokens: a sequence may end, or decode without speculation, before the draft catches
up; a later request that reuses such a block gets worse drafts, never different output). What the draft
computed of rejected drafts is overwritten later, as the target's is.

A layer-skip draft ("layers:N") is the target's first N decoder layers followed by its final norm and lm_head.
It shares the target's weights and the first N layers of its KV cache, which hold exactly what it would
compute, so it has nothing to catch up on and costs no memory.
"""
import dataclasses
from collections.abc import Callable
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import nn

from inferd.engine.model_runner import Chunk, ModelRunner
from inferd.engine.scheduler import ScheduledSeq
from inferd.engine.sequence import Sequence
from inferd.models.config import LoadedModel
from inferd.models.llama import LlamaForCausalLM
from inferd.models.loader import load_model

LAYERS = "layers:"


def layer_skip_depth(spec: str) -> int | None:
    """N for a "layers:N" speculative_model, None for a model path."""
    if not spec.startswith(LAYERS):
        return None
    n = spec.removeprefix(LAYERS)
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"speculative_model {spec!r}: give layers:N with N a positive number of layers")
    return int(n)


def load_draft(spec: str, target: LoadedModel) -> LoadedModel | None:
    """The draft model a speculative_model path names, checked against the target's tokenizer (None for
    layers:N, built from the target itself)."""
    if layer_skip_depth(spec) is not None:
        return None
    draft = load_model(spec, progress=False)
    check_same_tokenizer(target, draft)
    return draft


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Raises ValueError unless the draft's token ids mean what the target's do."""
    ours, theirs = target.tokenizer.hf_tokenizer.get_vocab(), draft.tokenizer.hf_tokenizer.get_vocab()
    if ours == theirs:
        return
    why = f"{len(theirs)} tokens against the target's {len(ours)}"
    if len(ours) == len(theirs):
        token = next(t for t, i in sorted(ours.items(), key=lambda x: x[1]) if theirs.get(t) != i)
        why = f"token {token!r} is id {ours[token]} in the target, {theirs.get(token)} in the draft"
    raise ValueError(f"the draft model {draft.name} does not share the tokenizer of {target.name} ({why}); "
                     "speculative decoding needs a draft of the same tokenizer")


def first_layers(target: LlamaForCausalLM, n: int) -> LlamaForCausalLM:
    """The target's embeddings, first n decoder layers, final norm and lm_head, shared (no weight is copied)."""
    if n >= target.config.num_layers:
        raise ValueError(f"a layer-skip draft must be shallower than the target's {target.config.num_layers} "
                         f"layers; got layers:{n}")
    with torch.device("meta"):  # placeholders only: every module is replaced by the target's
        draft = LlamaForCausalLM(dataclasses.replace(target.config, num_layers=n), 1)
    draft.embed_tokens, draft.norm, draft.lm_head, draft.rope = (target.embed_tokens, target.norm,
                                                                 target.lm_head, target.rope)
    draft.layers = nn.ModuleList(target.layers[:n])
    draft.use_kernels(target.kernels)
    return draft


class DraftModel:
    """Proposes drafts with a draft model's forward over the paged cache (see the module doc)."""

    def __init__(self, runner: ModelRunner, shares_target_kv: bool, vocab_size: int,
                 probs: Callable[[torch.Tensor, Sequence], torch.Tensor]):
        self.runner = runner
        self.shares_target_kv = shares_target_kv  # a layer-skip draft: the target's KV is the draft's
        self.vocab_size = vocab_size  # the target's: the draft's logits are cut or padded to it
        self.probs = probs  # a request's sampling distribution over logits rows (Sampler.probs)
        self.computed: WeakKeyDictionary[Sequence, int] = WeakKeyDictionary()  # leading tokens with draft KV

    def propose(self, seqs: list[Sequence], ks: list[int], prefills: list[ScheduledSeq]
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """ks[i] >= 1 drafts for seqs[i] (blocks for them allocated), and their q rows (k, vocab) when sampled.
        prefills: this step's prompt chunks, computed by the draft too."""
        logits = self._first_forward(seqs, prefills)
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor | None]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for j in range(max(ks, default=0)):
            if j:  # draft j at position len - 1 + j, after the last token
                logits = self.runner.forward([Chunk(seqs[i], len(seqs[i]) - 1 + j, drafts[i][-1:], 1)
                                              for i in active], [])
            logits = self._fit(logits)
            best = logits.argmax(dim=-1).tolist()
            for row, i in enumerate(active):
                token, q = (best[row], None) if seqs[i].params.greedy else self._sample(logits[row], seqs[i])
                drafts[i].append(token)
                qs[i].append(q)
            active = [i for i in active if ks[i] > j + 1]
        if not self.shares_target_kv:
            for seq, k in zip(seqs, ks):
                self.computed[seq] = len(seq) - 1 + k  # the last token and the first k - 1 drafts
        return drafts, [torch.stack(q) if q[0] is not None else None for q in qs]

    def _first_forward(self, seqs: list[Sequence], prefills: list[ScheduledSeq]) -> torch.Tensor:
        """Catches up on each decoding sequence and follows the prompt chunks; the logits after each one's last
        token, in seqs' order."""
        follow = [] if self.shares_target_kv else [self._follow(item) for item in prefills]
        first = [self._catch_up(seq) for seq in seqs]
        if not (first or follow):
            return torch.empty(0, self.vocab_size)
        order = sorted(range(len(seqs)), key=lambda i: len(first[i].token_ids) > 1)  # single tokens: decodes
        logits = self.runner.forward([first[i] for i in order if len(first[i].token_ids) == 1],
                                     [first[i] for i in order if len(first[i].token_ids) > 1] + follow)
        return logits[torch.tensor(order, dtype=torch.long).argsort()]

    def roll_back(self, seq: Sequence) -> None:
        """After verification: the draft's KV is right only up to what the target kept."""
        if seq in self.computed:
            self.computed[seq] = min(self.computed[seq], seq.num_computed_tokens)

    def _catch_up(self, seq: Sequence) -> Chunk:
        """The tokens of a decoding sequence the draft has not computed, its last one included."""
        last = len(seq) - 1
        start = last if self.shares_target_kv else min(self.computed.get(seq, 0), last)
        return Chunk(seq, start, seq.token_ids[start:], 1)

    def _follow(self, item: ScheduledSeq) -> Chunk:
        """The target's prompt chunk, from where the draft's KV ends if it lags (a preempted sequence restarts
        where the target does; a new one trusts the prefix cache as the target does)."""
        seq, begin = item.seq, item.seq.num_computed_tokens
        start = min(self.computed.get(seq, begin), begin)
        self.computed[seq] = begin + item.num_tokens
        return Chunk(seq, start, seq.token_ids[start:begin + item.num_tokens], 0)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Columns of the target's vocabulary (models of one tokenizer may pad their embeddings differently)."""
        extra = self.vocab_size - logits.shape[-1]
        return logits[:, :self.vocab_size] if extra <= 0 else F.pad(logits, (0, extra), value=float("-inf"))

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor]:
        q = self.probs(logits.unsqueeze(0), seq)[0]
        return int(torch.multinomial(q, 1, generator=seq.generator)), q
