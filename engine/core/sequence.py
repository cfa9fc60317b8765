import itertools
from array import array
from enum import Enum, auto
from typing import NamedTuple

from engine.core.sampling_params import SamplingParams

# Stands in, at the end of token_ids, for a token the device is still sampling: with the host's
# work overlapped with the GPU (engine.llm), the next step is planned before this one's tokens are
# known, and takes the sampled token as its input on the device. Never a valid token id.
PENDING_TOKEN = -1


class TokenLogprobs(NamedTuple):
    """A generated token's log-probability and the most likely tokens' at its step (SamplingParams'
    logprobs says under which distribution), most likely first; -inf for a token that was not
    allowed there."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability)


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its tokens, how many of them have KV in the cache, and the blocks holding it.

    A preempted sequence keeps its token ids (prompt and completion so far) and recomputes their
    KV when it is scheduled again, so nothing it generated is lost or repeated. While a step that
    samples its next token is in flight, token_ids ends in PENDING_TOKEN (counted by num_tokens);
    the finished sequence holds none.

    A request for n > 1 samples is n sequences: the first prefills the prompt and holds the others
    in `forks` until then. The step that finishes its prompt samples every one of them from the
    prompt's last logits; each then goes its own way from its first token, taking the prompt's full
    blocks from the prefix cache (engine.llm: LLM._fork).
    """

    _ids = itertools.count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int,
                 max_model_len: int | None = None):
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.block_size = block_size
        # The length at which the request ends with "length": max_tokens, or the model's limit.
        limit = self.num_prompt_tokens + params.max_tokens
        self.max_num_tokens = limit if max_model_len is None else min(limit, max_model_len)
        # Tokens whose KV is in the cache; the scheduler moves it forward chunk by chunk.
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache at the last admission (for stats).
        self.num_cached_tokens = 0
        # array('i') rather than a list: the runner turns a batch of them into one tensor by
        # joining their bytes, ~20x faster than from nested lists at batch 256.
        self.block_table = array("i")
        # Chained hashes of this sequence's full blocks, in order; valid for the token ids.
        self.block_hashes: list[int] = []
        # Leading entries of block_table whose hashes are registered with the BlockManager.
        self.num_committed_blocks = 0
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # Set when the caller wants text as it is generated (streaming or stop strings).
        self.detokenizer = None
        # Which of its request's n samples this is, and (the first only) the others, not yet
        # started: its prompt's last step samples them too.
        self.sample_index = 0
        self.forks: list[Sequence] = []
        # Set by the scheduler while the forks hold places among its max_num_seqs.
        self.forks_reserved = False
        # Structured output's grammar state (engine.text.structured_output), advanced token by token.
        self.matcher = None
        # With params.logprobs set: a TokenLogprobs per completion token.
        self.logprobs: list | None = [] if params.logprobs is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def samples_at(self, end: int) -> list["Sequence"]:
        """The sequences whose next token a step running this one's tokens up to `end` samples:
        itself when that is all its tokens, with its forks when those are the prompt's."""
        if end != len(self.token_ids):
            return []
        if self.forks and end == self.num_prompt_tokens:
            return [self, *(f for f in self.forks if not f.is_finished)]
        return [self]

    def drop_pending_tokens(self) -> None:
        """Forgets tokens still being sampled: the request has ended, so they are not its tokens."""
        while self.token_ids and self.token_ids[-1] == PENDING_TOKEN:
            self.token_ids.pop()

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size
