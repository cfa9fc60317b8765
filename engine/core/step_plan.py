"""Turns the scheduler's choice for one step into plain lists: which tokens run, where their K/V
go, which rows get sampled; and what the KV cache's tiers copy ahead of it (KVTransfers). Plain
data, so tensor-parallel workers can be sent the same plan."""
from array import array
from dataclasses import dataclass, field

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import PENDING_TOKEN, Sequence


@dataclass(slots=True)
class SampleContext:
    """What sampling one row needs beyond its SamplingParams (a row whose params are plain has
    None in StepPlan.sample_contexts)."""

    # The tokens the penalties count (None without penalties): the first history_len of them (all
    # when history_len is None), the sequence's tokens before the row's input token. The input
    # token itself is on the device: the step before may still be sampling it. plan_step passes
    # the sequence's own token list, which only grows past history_len, so that a step copies a
    # history only when something reads it (the eager sampler, or a decode graph's counts being
    # built for the sequence).
    tokens: list[int] | array | None
    num_prompt_tokens: int
    # Tokens the row may not sample now: the end-of-sequence ids while min_tokens is not reached.
    banned: tuple[int, ...] = ()
    # Under structured output: the row's token mask is computed from its grammar's state when the
    # step samples (LLM.step), after the token before it has landed.
    constrained: bool = False
    history_len: int | None = None
    # The sampled sequence's id: a decode graph keeps its token counts on the device between steps.
    seq_id: int | None = None

    @property
    def history(self) -> array | None:
        """The tokens before the row's input token, or None without penalties."""
        if self.tokens is None:
            return None
        if self.history_len is None:
            return self.tokens if isinstance(self.tokens, array) else array("q", self.tokens)
        return array("q", self.tokens[:self.history_len])

    @property
    def num_history(self) -> int:
        return len(self.tokens) if self.history_len is None else self.history_len


def sample_context(seq: Sequence, end: int, eos_ids: tuple[int, ...]) -> SampleContext | None:
    """The context of sampling seq's token after its first `end` tokens."""
    p = seq.params
    if p.plain:
        return None
    banned = eos_ids if p.min_tokens and end - seq.num_prompt_tokens < p.min_tokens else ()
    return SampleContext(seq.token_ids if p.has_penalties else None, seq.num_prompt_tokens, banned,
                         p.structured_output is not None, end - 1, seq.seq_id)


@dataclass
class StepPlan:
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    cu_seqlens_q: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # query rows whose next-token logits are sampled
    sample_params: list[SamplingParams]
    is_decode: bool  # one query token per sequence: the CUDA-graph path
    # Rows whose input is a token the step before this one is still sampling (PENDING_TOKEN in
    # input_ids), and each one's row in that step's sampled tokens, which the device copies in.
    feed_rows: list[int] = field(default_factory=list)
    feed_from: list[int] = field(default_factory=list)
    # Per sampled row: its SampleContext, or None when its params are plain. Empty: all plain.
    sample_contexts: list[SampleContext | None] = field(default_factory=list)
    # Some row is under structured output: the runner computes the logits and waits for its masks
    # (ModelRunner.sample_deferred) before sampling.
    defer_sampling: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def longest_first(self) -> list[int]:
        """The rows by context length, longest first: the order in which a decode step's attention
        starts its sequences (kernels/decode_attention.py's seq_order says why)."""
        lens = self.context_lens
        return sorted(range(len(lens)), key=lens.__getitem__, reverse=True)

    @property
    def max_seqlen_q(self) -> int:
        if self.is_decode:
            return 1
        cu = self.cu_seqlens_q
        return max(b - a for a, b in zip(cu, cu[1:]))

    @property
    def sample_positions(self) -> list[int]:
        """Position of each token about to be sampled; seeded draws are keyed on it."""
        return [self.positions[r] + 1 for r in self.sample_rows]


def plan_step(batch: list[tuple[Sequence, int]], block_size: int,
              pending: dict[Sequence, int] | None = None, eos_ids: tuple[int, ...] = ()) -> StepPlan:
    """batch: each sequence with the number of its uncomputed tokens to run this step (at least one).
    pending: the sequences whose last token the step in flight is sampling, each with its row
    among that step's sampled tokens. eos_ids: the tokens min_tokens keeps out. A prompt's last
    chunk samples one row for each sequence samples_at() names (n > 1: the same query row)."""
    input_ids, positions, slots, cu, lens, tables, rows, params = [], [], [], [0], [], [], [], []
    feed_rows, feed_from, contexts = [], [], []
    total = 0
    for seq, n in batch:
        start = seq.num_computed_tokens
        end = start + n
        table = seq.block_table
        token_ids = seq.token_ids
        if n == 1:  # the decode case, most of every big batch: skip the slicing and comprehensions
            input_ids.append(token_ids[start])
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            input_ids += token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        total += n
        cu.append(total)
        lens.append(end)
        tables.append(table)
        if end == len(token_ids):  # the chunk reaches the end: its last row predicts the next token
            for sampled in seq.samples_at(end):
                rows.append(total - 1)
                params.append(sampled.params)
                contexts.append(None if sampled.params.plain else sample_context(sampled, end, eos_ids))
            # A pending token is only ever a sequence's last, so this is the one row it can be in.
            row = pending.get(seq) if pending else None
            if row is not None:
                feed_rows.append(total - 1)
                feed_from.append(row)
            elif token_ids[-1] == PENDING_TOKEN:
                raise RuntimeError(f"sequence {seq.seq_id} would run a token that no step in flight is sampling")
    # Every sequence runs at least one token, so one token per sequence is a decode step.
    if not any(contexts):
        contexts = []
    return StepPlan(input_ids, positions, slots, cu, lens, tables, rows, params, is_decode=total == len(batch),
                    feed_rows=feed_rows, feed_from=feed_from, sample_contexts=contexts,
                    defer_sampling=any(c is not None and c.constrained for c in contexts))


@dataclass
class KVTransfers:
    """The copies between the KV cache's tiers that go with one step (engine/core/kv_tiers.py
    decides them, the runner's engine/runner/kv_tiers.py makes them), queued ahead of the step's
    forward pass. Every rank makes the same copies of its own shard.

    Device <-> host copies run on copy streams of their own on a GPU, each ordered after the work
    already queued on the device; the waits say where the step must wait for them."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot): device -> host
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block): host -> device
    batch: int = 0  # names these loads, so that a later step can wait for them (wait_loads)
    wait_saves: bool = False  # the step overwrites blocks whose saves may be under way: it waits for them
    wait_loads: int = 0  # the step reads or overwrites blocks that loads up to this batch fill: it waits for them
    # Host slot <-> disk, in the background: (host slot, chained hash, token ids) written to a file,
    # (chained hash, host slot, token ids) read from one (checked against them), and files removed.
    writes: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    fetches: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    deletes: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.wait_saves or self.wait_loads or self.writes or self.fetches
                     or self.deletes)
