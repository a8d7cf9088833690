import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inferd.engine.block_manager import BlockManager
from inferd.engine.config import EngineConfig
from inferd.engine.draft import DraftModel, first_layers, layer_skip_depth, load_draft
from inferd.engine.grammar import GrammarCompiler, GrammarMasker, accept_token
from inferd.engine.model_runner import ModelRunner, kv_cache_bytes_per_block
from inferd.engine.request import EngineError, RequestOutput, SamplingParams, TokenLogprob
from inferd.engine.sampler import Sampler, prompt_logprobs
from inferd.engine.spec_decode import SpecConfig, Speculator
from inferd.engine.scheduler import Batch, ScheduledSeq, Scheduler
from inferd.engine.sequence import Sequence
from inferd.kernels.select import auto_quantization, bf16_weights, int4_rule, native_bf16
from inferd.kernels.variants import load_kernels
from inferd.models.config import LoadedModel
from inferd.models.cores import CoreShare, allowed_cpus
from inferd.models.huge_pages import move_weights
from inferd.models.int4 import int4_available, quantize_int4_linears, takes
from inferd.models.int4_kernel import load_int4_kernel
from inferd.models.llama import LlamaForCausalLM, StepInterrupted
from inferd.models.packed import one_row_ops, pack_linears, panel_linears
from inferd.models.cpu_kernels import kernels_for
from inferd.models.quant import Int8Linear, SmallRowsInt8, quantize_linears

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, quantization: str = "none") -> torch.dtype:
    """auto: what the weight format computes in (int4 bf16, int8 fp32), else bf16 where the CPU has it natively."""
    if name == "auto":
        if quantization == "int4":  # float32 rows on our kernel where bf16 is emulated (AVX2)
            return torch.bfloat16 if native_bf16() or load_int4_kernel() is None else torch.float32
        if quantization == "int8":
            return torch.float32
        return torch.bfloat16 if native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def uses_bf16_weights(config: EngineConfig, quantization: str, dtype: torch.dtype) -> bool:
    """`--dtype auto` resolved to float32 without quantization keeps the linears' weights in bf16 where
    inferd.kernels.select.bf16_weights says (our kernel there); an explicit float32 keeps float32 weights."""
    if config.dtype != "auto" or quantization != "none" or dtype is not torch.float32 or not bf16_weights():
        return False
    kernels = kernels_for(torch.float32, config.cpp_kernels)
    return hasattr(kernels, "bf16w_linear_native") and kernels.bf16w_linear_native()


def resolve_quantization(name: str, dtype: str) -> str:
    """auto: the CPU's rule (inferd.kernels.select.auto_quantization), then none where its kernel is missing here."""
    if name != "auto":
        return name
    choice = auto_quantization(dtype)
    if choice == "int4" and load_int4_kernel() is None and not (native_bf16() and dtype in ("auto", "bfloat16")):
        choice = "int8"  # int4's float32 rows need our AVX2 loops
    if (choice == "int4" and not int4_available()) or (choice == "int8" and load_kernels() is None):
        return "none"
    return choice


@dataclass(slots=True)
class Arrivals:
    """How a step takes requests that arrive while it runs (AsyncEngine's inbox)."""
    added: Callable[[], bool]  # adds those that arrived since it was last called; True if any did
    deliver: Callable[[list[RequestOutput]], None]  # hands out the outputs of a step nested in the one in flight


class LLMEngine:
    """Synchronous core: add requests, call step(), get outputs. Not thread-safe."""

    def __init__(self, model: LoadedModel, config: EngineConfig):
        self.num_threads = config.num_threads or len(allowed_cpus())
        self.cores = CoreShare.of_this_process(self.num_threads, config.adapt_threads)  # fewer while others use them
        torch.set_num_threads(self.num_threads)
        self.small_step_threads = config.small_step_threads or self.num_threads
        self.config = config
        self.tokenizer = model.tokenizer
        self.model_name = model.name
        self.quantization = resolve_quantization(config.quantization, config.dtype)
        self.dtype = resolve_dtype(config.dtype, self.quantization)
        self.bf16_weights = uses_bf16_weights(config, self.quantization, self.dtype)  # float32 rows, bf16 weights
        mc = model.config
        if config.max_model_len and config.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length "
                             f"{mc.max_position_embeddings}")
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.eos_token_ids = set(model.tokenizer.eos_token_ids) | set(mc.eos_token_ids)
        self.model = self._network(model)
        draft = load_draft(config.speculative_model, model) if config.speculative_model else None
        block_bytes = sum(kv_cache_bytes_per_block(m.config, config.block_size, self.dtype) for m in (model, draft)
                          if m is not None)  # a draft model's KV cache has the target's blocks
        num_blocks = config.num_kv_blocks or int(config.kv_cache_gib * 2**30 // block_bytes)
        if num_blocks < 1:
            raise ValueError(f"a KV cache of {config.kv_cache_gib} GiB holds no {config.block_size}-token block "
                             "of this model; raise kv_cache_gib")
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_capacity_tokens = num_blocks * config.block_size
        if self.kv_capacity_tokens < self.max_model_len:
            log.warning("the KV cache holds %d tokens, less than max_model_len %d: requests are limited to %d",
                        self.kv_capacity_tokens, self.max_model_len, self.kv_capacity_tokens)
        self.scheduler = Scheduler(config, self.blocks)
        self.runner = ModelRunner(self.model, self.blocks, self.dtype)
        self.sampler = Sampler(kernels=kernels_for(torch.float32, config.cpp_kernels))
        self.grammars = GrammarCompiler(model.tokenizer, sorted(self.eos_token_ids))
        self.masker = GrammarMasker(self.grammars, mc.vocab_size)
        self.seqs: dict[str, Sequence] = {}
        self.num_interrupted_steps = 0  # lower-class steps given up for a better request (step's outranked)
        self.num_nested_prefills = 0  # sequences prefilled inside a step in flight (step's arrivals)
        spec = SpecConfig(config.num_speculative_tokens)
        proposer = self._draft_model(draft) if config.speculative_model else None
        self.speculator = Speculator(spec, self.blocks, self.max_model_len, proposer) if spec.num_draft_tokens else None
        log.info("engine: dtype=%s%s quantization=%s kv_blocks=%d block_size=%d max_model_len=%d prefix_caching=%s",
                 self.dtype, " (weights bfloat16)" if self.bf16_weights else "", self.quantization, num_blocks, config.block_size, self.max_model_len, "on" if config.enable_prefix_caching else "off")
        if self.speculator is not None:
            log.info("speculative decoding: %d drafts per step from %s", spec.num_draft_tokens,
                     config.speculative_model or "prompt lookup")

    def _network(self, model: LoadedModel) -> LlamaForCausalLM:
        net = LlamaForCausalLM(model.config, self.max_model_len)
        net.load_weights(model.weights)
        head8 = None
        if self.quantization == "int4":  # from the float32 weights: a Q4_1 source's blocks come back exactly;
            # lm_head (tied: the embedding, Q8_0 in the packaged file) is not 4-bit: that costs 3.7 % perplexity.
            # It runs int8 at a few rows (where the kernel builds), its dense copy above. The 4-bit linears take
            # the model's dtype where our kernel does (bf16 with AVX-512 BF16, float32 with AVX2), else bf16.
            kernel = load_int4_kernel()
            rows = self.dtype if kernel is not None and takes(kernel, self.dtype) else torch.bfloat16
            kernel = kernel if kernel is not None and takes(kernel, rows) else None
            _, dense_above = int4_rule(str(rows).removeprefix("torch."), kernel is not None)
            quantize_int4_linears(net, dense_above, ("lm_head",), rows, kernel)
            if (kernel := load_kernels()) is not None:
                head8 = Int8Linear(net.lm_head, kernel)
        net = net.to(self.dtype).eval()
        if self.quantization == "int8":
            quantize_linears(net, load_kernels())
        kernels = kernels_for(self.dtype, self.config.cpp_kernels)
        if self.bf16_weights:
            panel_linears(net, kernels)
        elif self.config.pack_weights:  # one row: only where the linears are bf16 for every batch (int4: 4-bit first)
            one_row = self.quantization == "none" and self.config.one_row_weights
            pack_linears(net, self.dtype, one_row_ops(kernels, self.dtype) if one_row else None)
        if head8 is not None:
            net.lm_head = SmallRowsInt8(head8, net.lm_head)
        if self.config.huge_page_weights:
            move_weights(net)
        net.use_kernels(kernels)  # binds the weights into the layers' ops
        return net

    def _draft_model(self, draft: LoadedModel | None) -> DraftModel:
        """The draft model on its own KV cache or (draft None, layers:N) the target's first N layers on its cache."""
        vocab = self.model.config.vocab_size
        if draft is not None:
            return DraftModel(ModelRunner(self._network(draft), self.blocks, self.dtype), False, vocab,
                              self.sampler.probs)
        n = layer_skip_depth(self.config.speculative_model)
        runner = ModelRunner(first_layers(self.model, n), self.blocks, self.dtype, self.runner.kv_cache[:n])
        return DraftModel(runner, True, vocab, self.sampler.probs)

    # ---- requests

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raises EngineError for a request that can never run here. Cheap; call before add_request."""
        if num_prompt_tokens == 0:
            raise EngineError("the prompt is empty")
        total = num_prompt_tokens + params.max_tokens
        limit = self.context_limit
        if total > limit:
            held = " (all its KV cache holds)" if limit < self.max_model_len else ""
            raise EngineError(f"this replica's maximum context length is {limit} tokens{held}; the request needs "
                              f"{total} ({num_prompt_tokens} in the prompt, {params.max_tokens} to generate)")

    @property
    def context_limit(self) -> int:
        """Most tokens (prompt + output) one request may hold: the model's context, or the whole KV pool if less."""
        return min(self.max_model_len, self.kv_capacity_tokens)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_namespace: str = "default", grammar=None, priority: int = 0) -> None:
        """cache_namespace: prefix-cache blocks are reused only by requests of the same namespace (a tenant).
        grammar: a matcher from self.grammars for params.response_format, made off this thread (AsyncEngine);
        made here if not given."""
        self.check_request(len(prompt_token_ids), params)
        if request_id in self.seqs:
            raise EngineError(f"request id {request_id!r} is already running")
        if params.response_format is not None and grammar is None:
            grammar = self.grammars.matcher(params.response_format)
        stream = self.tokenizer.new_decode_stream(params.skip_special_tokens)
        seq = Sequence(request_id, prompt_token_ids, params, stream, cache_namespace,
                       self._public_prefix_len(prompt_token_ids), grammar)
        seq.priority = priority
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _public_prefix_len(self, prompt_token_ids: list[int]) -> int:
        """Length of the longest public prefix (EngineConfig.public_prefixes) the prompt starts with."""
        return max((len(p) for p in self.config.public_prefixes if prompt_token_ids[:len(p)] == p), default=0)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        return self._output(seq, [], [])

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step

    def step(self, outranked: Callable[[int], bool] | None = None, arrivals: Arrivals | None = None
             ) -> list[RequestOutput]:
        """One forward of the scheduled batch and its tokens. outranked(p): whether a request better than class
        p arrived since this step was scheduled; a step of lower classes only (no drafts, no grammar) then stops
        between layers and computes nothing, so that the next step schedules that request at once.
        arrivals: asked between layers for requests that arrived meanwhile; those that join (Scheduler.join)
        are prefilled in a step of their own right there, and its outputs handed to arrivals.deliver, so that
        a new prompt's first token waits for no other request's step."""
        batch = self.scheduler.schedule()
        if batch.seqs and self.speculator is not None:
            self.speculator.draft(batch)
        return self.run_batch(batch, outranked, arrivals) if batch.seqs else []

    def run_batch(self, batch: Batch, outranked: Callable[[int], bool] | None = None,
                  arrivals: Arrivals | None = None) -> list[RequestOutput]:
        sampling = [item.seq for item in batch.seqs if item.samples and not item.draft]
        masks = self.masker.start(sampling)  # grammar masks, computed while the forward runs
        best = min(item.seq.priority for item in batch.seqs)
        stop = outranked is not None and best > 0 and masks is None and not any(item.draft for item in batch.seqs)
        join = arrivals is not None and masks is None and self.speculator is None
        small = not batch.prefills and len(batch.decodes) <= self.config.small_step_seqs
        threads = min(self.small_step_threads if small else self.num_threads, self.cores.threads())
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

        budget = self.config.max_num_batched_tokens - batch.num_tokens  # this step's and its nested ones'

        def between() -> None:
            nonlocal budget
            if stop and outranked(best):
                raise StepInterrupted("a better class arrived")
            if join and budget > 0 and arrivals.added():
                nested = self.scheduler.join(budget, best)
                if nested.seqs:
                    budget -= nested.num_tokens
                    self.num_nested_prefills += len(nested.seqs)
                    arrivals.deliver(self.run_batch(nested))
                    torch.set_num_threads(threads)
        try:
            logits = self.runner.run(batch, between if stop or join else None)
        except StepInterrupted:
            self.num_interrupted_steps += 1
            return []
        logits, verifying, scored = _split_logits(batch, logits)
        prompt_only = [item.seq for item in batch.seqs if item.reaches_end and not item.samples]
        for item in batch.seqs:
            if not item.draft:
                item.seq.num_computed_tokens += item.num_tokens
                self.blocks.cache_full_blocks(item.seq)
        for seq, first, rows in scored:
            targets = seq.token_ids[first:first + rows.shape[0]]
            seq.prompt_logprobs += prompt_logprobs(rows, targets, seq.params.top_logprobs)
        if masks is not None:
            masks.apply(logits)
        tokens, logprobs = self.sampler(logits, sampling) if sampling else ([], [])
        now = time.monotonic()
        outputs = [self._append(seq, token, lp, now) for seq, token, lp in zip(sampling, tokens, logprobs)]
        outputs += [self._finish_prompt_only(seq) for seq in prompt_only]
        return outputs + [out for item, rows in verifying for out in self._verified(item, rows, now)]

    def _finish_prompt_only(self, seq: Sequence) -> RequestOutput:
        """A max_tokens 0 request ends once its prompt is computed (its prompt logprobs, if asked, are in)."""
        self.seqs.pop(seq.request_id, None)
        self.scheduler.finish(seq, "length")
        return self._output(seq, [], [])

    def _verified(self, item: ScheduledSeq, rows: torch.Tensor, now: float) -> list[RequestOutput]:
        outputs = []
        for token in self.speculator.verify(item, rows, self.sampler.probs):
            outputs.append(self._append(item.seq, token, None, now))
            if item.seq.is_finished:
                return outputs
        self.blocks.cache_full_blocks(item.seq)
        return outputs

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None, now: float) -> RequestOutput:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if logprob is not None:
            seq.logprobs.append(logprob)
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self.seqs.pop(seq.request_id, None)
            self.scheduler.finish(seq, reason)
        return self._output(seq, seq.token_ids[-1:], seq.logprobs[-1:] if logprob else [])

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.grammar is not None and not accept_token(seq.grammar, token):
            return "abort"
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        piece = seq.decode_stream.step(token)
        if piece:
            seq.text += piece
            if p.stop and _cut_at_stop(seq, len(seq.text) - len(piece)):
                return "stop"
        if seq.grammar is not None and seq.grammar.is_stopped():  # the JSON is complete
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, token_ids: list[int], logprobs: list) -> RequestOutput:
        end = len(seq.text) if seq.is_finished else len(seq.text) - _held_back(seq)
        text = seq.text[seq.num_sent_chars:end] if end > seq.num_sent_chars else ""
        seq.num_sent_chars = max(seq.num_sent_chars, end)
        queue_s = seq.first_scheduled_time - seq.arrival_time if seq.first_scheduled_time else None
        first = len(token_ids) == seq.num_output_tokens  # the request's first output (its prompt is computed)
        prompt = seq.prompt_logprobs if seq.params.prompt_logprobs and first else None
        return RequestOutput(seq.request_id, text, token_ids, logprobs if seq.params.logprobs else None,
                             seq.is_finished, seq.finish_reason, seq.num_prompt_tokens, seq.num_output_tokens,
                             seq.first_token_time, queue_s, seq.num_cached_tokens, prompt)


Verifying = list[tuple[ScheduledSeq, torch.Tensor]]
Scored = list[tuple[Sequence, int, torch.Tensor]]  # a sequence, its first prompt token scored, the rows scoring


def _split_logits(batch: Batch, logits: torch.Tensor) -> tuple[torch.Tensor, Verifying, Scored]:
    """The runner's rows (ScheduledSeq.num_logits per item, in batch order; call before the items' tokens count
    as computed) as: one row per sequence that samples without drafts, each verifying sequence with its 1 + k
    rows, and each sequence with prompt logprobs to add with the rows that score them."""
    plain, verifying, scored, row = [], [], [], 0
    for item in batch.seqs:
        n, num_scored = item.num_logits, item.num_prompt_logprobs
        if num_scored:
            first = max(item.seq.num_computed_tokens, len(item.seq.prompt_logprobs)) + 1
            scored.append((item.seq, first, logits[row:row + num_scored]))
        if item.draft:
            verifying.append((item, logits[row + num_scored:row + n]))
        elif item.samples:
            plain.append(row + num_scored)
        row += n
    assert row == logits.shape[0]
    return logits if len(plain) == logits.shape[0] else logits[plain], verifying, scored


def _cut_at_stop(seq: Sequence, new_from: int) -> bool:
    """Cuts seq.text at the first stop string that ends in the new text; True if one did."""
    longest = max(len(s) for s in seq.params.stop)
    start = max(0, new_from - longest + 1)
    hits = [i for i in (seq.text.find(s, start) for s in seq.params.stop) if i >= 0]
    if not hits:
        return False
    seq.text = seq.text[:min(hits)]
    return True


def _held_back(seq: Sequence) -> int:
    """Length of the text's tail that could still become a stop string: not sent yet."""
    for n in range(min(len(seq.text), max((len(s) for s in seq.params.stop), default=0)), 0, -1):
        tail = seq.text[-n:]
        if any(s.startswith(tail) for s in seq.params.stop):
            return n
    return 0
