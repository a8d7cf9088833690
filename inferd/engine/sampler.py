"""Per-request sampling over one batch of logits.

Logprobs are those of the model (before penalties and temperature), as
vLLM reports them. A random draw inverts the row's distribution function: one
uniform per row, searched in the float64 cumulative sum of its probabilities,
from a per-sequence generator when the request has a seed, so a seeded request
gives the same tokens whatever else is in the batch. (The exponential race,
argmax of p / E, draws one number per vocabulary entry on one thread: 28.5 ms
at 32 rows of SmolLM2's 49,152 tokens, against 1.6 ms for this; benchmarks/sampler.py.)
The draw runs as one C++ op over the rows (`sample_rows` of inferd.models.cpu_kernels:
weights, their float64 sums and the search in one pass per row, rows on all threads)
or, where that is not built, as the same steps in torch; so does the greedy pick (`best_rows`).
"""
import torch

from inferd.engine.request import TokenLogprob
from inferd.engine.sequence import Sequence
from inferd.models.cpu_kernels import TorchKernels


class Sampler:
    def __init__(self, seed: int | None = None, kernels=TorchKernels):
        """kernels: where the draw and the greedy pick run (`sample_rows`, `best_rows` of inferd.models.cpu_kernels:
        the C++ ops or torch's)."""
        self.kernels = kernels
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
        assert logits.shape[0] == len(seqs)
        logprobs = _logprobs(logits, seqs)
        logits = _apply_penalties(logits, seqs)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if len(random_rows) == len(seqs):
            tokens = self._sample(logits, seqs)
        else:
            tokens = self.kernels.best_rows(logits.float().contiguous())
            if random_rows:
                rows = torch.tensor(random_rows)
                tokens[rows] = self._sample(logits[rows], [seqs[i] for i in random_rows])
        tokens = tokens.tolist()
        return tokens, [_entry(lp, t) if lp is not None else None for lp, t in zip(logprobs, tokens)]

    def probs(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """The distribution one sampled request draws from at each row: temperature, then top-k/top-p."""
        logits = _top_k_top_p(logits / seq.params.temperature, [seq] * logits.shape[0])
        return logits.softmax(dim=-1)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temperature = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32)
        if _has_top_k_top_p(seqs):  # top-p is taken after the temperature: the draw then scales by 1
            logits = _top_k_top_p(logits / temperature.unsqueeze(1), seqs)
            temperature = torch.ones_like(temperature)
        u = torch.rand(len(seqs), generator=self.generator, dtype=torch.float64)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                u[i] = torch.rand(1, generator=seq.generator, dtype=torch.float64)
        return self.kernels.sample_rows(logits.float().contiguous(), temperature, u)


def prompt_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Each row's logprob of its token (the prompt token after the row's position), with the top_n best."""
    lp = logits.log_softmax(dim=-1)
    chosen = lp.gather(1, torch.tensor(token_ids).unsqueeze(1)).squeeze(1).tolist()
    if not top_n:
        return [TokenLogprob(t, v, []) for t, v in zip(token_ids, chosen)]
    values, ids = lp.topk(top_n, dim=-1)
    return [TokenLogprob(t, v, list(zip(i, w))) for t, v, i, w in zip(token_ids, chosen, ids.tolist(),
                                                                          values.tolist())]


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rows = [i for i, s in enumerate(seqs) if s.params.presence_penalty or s.params.frequency_penalty]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        p, out = seqs[i].params, seqs[i].output_token_ids
        if not out:
            continue
        counts = torch.bincount(torch.tensor(out), minlength=logits.shape[1])[: logits.shape[1]].to(logits.dtype)
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _has_top_k_top_p(seqs: list[Sequence]) -> bool:
    return any(s.params.top_k for s in seqs) or any(s.params.top_p < 1.0 for s in seqs)


def _top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    if not _has_top_k_top_p(seqs):
        return logits
    top_k = [s.params.top_k for s in seqs]
    top_p = [s.params.top_p for s in seqs]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    k = torch.tensor([x if x > 0 else vocab for x in top_k]).clamp(max=vocab)
    cut = torch.arange(vocab).unsqueeze(0) >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    cut |= before >= torch.tensor(top_p).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprobs(logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[torch.Tensor, list] | None]:
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs]
    out: list = [None] * len(seqs)
    if not rows:
        return out
    lp = logits[rows].log_softmax(dim=-1)
    k = max(seqs[i].params.top_logprobs for i in rows)
    top_values, top_ids = lp.topk(k, dim=-1) if k else (None, None)
    for j, i in enumerate(rows):
        n = seqs[i].params.top_logprobs
        top = list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist())) if n else []
        out[i] = (lp[j], top)
    return out


def _entry(logprob: tuple[torch.Tensor, list], token: int) -> TokenLogprob:
    row, top = logprob
    return TokenLogprob(token, row[token].item(), top)
