import itertools
from array import array
from enum import Enum, auto

from engine.core.sampling_params import SamplingParams

# Stands in, at the end of token_ids, for a token the device is still sampling: with the host's
# work overlapped with the GPU (engine.llm), the next step is planned before this one's tokens are
# known, and takes the sampled token as its input on the device. Never a valid token id.
PENDING_TOKEN = -1


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

    def drop_pending_tokens(self) -> None:
        """Forgets tokens still being sampled: the request has ended, so they are not its tokens."""
        while self.token_ids and self.token_ids[-1] == PENDING_TOKEN:
            self.token_ids.pop()

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size
