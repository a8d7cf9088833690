import time
from enum import Enum, auto

import torch

from inferd.engine.request import SamplingParams, TokenLogprob


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One generation: the prompt, the tokens produced so far and where its KV lives."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, decode_stream=None,
                 cache_namespace: str = "default", num_public_tokens: int = 0, grammar=None):
        assert prompt_token_ids, "empty prompt"
        assert 0 <= num_public_tokens <= len(prompt_token_ids)
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.cache_namespace = cache_namespace  # prefix-cache blocks are shared only within one namespace
        self.num_public_tokens = num_public_tokens  # leading prompt tokens of a public prefix, shared by all
        self.block_hashes: list[bytes] = []  # of the leading full blocks of token_ids, filled as needed
        self.num_offered_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache when first scheduled
        self.arrival_time = time.monotonic()
        self.priority = 0  # scheduling class: 0 interactive, 1 batch (lower runs first under the priority policy)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.decode_stream = decode_stream
        self.text = ""  # output text so far, cut at a stop string
        self.num_sent_chars = 0
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] = []  # of prompt tokens 1, 2, ... as their positions are computed
        self.finish_reason: str | None = None
        self.grammar = grammar  # an llguidance matcher when the output is constrained (engine.grammar)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
