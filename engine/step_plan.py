"""Turns the scheduler's choice for one step into plain lists: which tokens run, where their K/V
go, which rows get sampled. Plain data, so tensor-parallel workers can be sent the same plan."""
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


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

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def max_seqlen_q(self) -> int:
        cu = self.cu_seqlens_q
        return max(b - a for a, b in zip(cu, cu[1:]))

    @property
    def sample_positions(self) -> list[int]:
        """Position of each token about to be sampled; seeded draws are keyed on it."""
        return [self.positions[r] + 1 for r in self.sample_rows]


def plan_step(batch: list[tuple[Sequence, int]], block_size: int) -> StepPlan:
    """batch: each sequence with the number of its uncomputed tokens to run this step."""
    input_ids, positions, slots, cu, lens, tables, rows, params = [], [], [], [0], [], [], [], []
    for seq, n in batch:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        table = seq.block_table
        if n == 1:  # the decode case, most of every big batch: skip the slicing and comprehensions
            input_ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        cu.append(cu[-1] + n)
        lens.append(end)
        tables.append(table)
        if end == seq.num_tokens:  # the chunk reaches the end: its last row predicts the next token
            rows.append(cu[-1] - 1)
            params.append(seq.params)
    return StepPlan(input_ids, positions, slots, cu, lens, tables, rows, params,
                    is_decode=all(n == 1 for _, n in batch))
