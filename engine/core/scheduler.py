"""Chooses what each step runs: which sequences, and how many of their tokens.

Every step first serves the running sequences (one token each while decoding, or the next chunk
of a prompt still being prefilled), then admits waiting prompts with the token budget left. So a
long prompt is prefilled in chunks mixed into decode steps instead of stalling every stream; a
step that carries prompt tokens while others decode holds at most max_prefill_chunk tokens.
When blocks run out, the most recently admitted sequence is preempted: its blocks are freed and
it goes back to the front of the queue, to be recomputed from its tokens (no token is lost).

A prompt's full blocks become reusable as soon as a step is scheduled to compute them: prompts
that share a system prompt and arrive together, or while the first is still being prefilled, take
its blocks from the prefix cache instead of computing them again, even within the same step; a
prompt whose next shared block another prompt's next chunk will compute waits for that chunk.

With the host's work overlapped with the GPU (engine.llm), a step is scheduled while the one
before it still samples: each sequence that samples there already ends in a pending token, so it
decodes that token next. A sequence whose pending token is its last by length is not run again.

With the KV cache's lower tiers (engine/core/kv_tiers.py), a prompt's blocks found on the host
are copied back instead of computed; while other work runs, the prompt waits in `running` for its
copies to end. One whose blocks are on disk waits at the head of the queue while they are read.
"""
from collections import deque

from engine.core.block_manager import BlockManager
from engine.core.kv_tiers import FETCHING, KVTiers
from engine.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus


class Scheduler:
    # While streams decode, a prompt chunk's attention grows with the context before it (each query
    # reads every earlier key): past this context the chunk shrinks so that chunk x context, and so
    # the streams' step time, stays about what a full chunk costs here. On the H200 (0.6B shape) a
    # 120-token chunk's attention went from ~22 us per layer over 2K keys to ~46 over 8K.
    full_chunk_context = 4096
    # But not below 64 tokens: a query tile costs about the same however few of its rows are used,
    # so a smaller chunk mostly stretches the prefill. With the prefill kernel's small-step tiles
    # (32 queries for Qwen3's GQA group of 2), 32-token chunks left the streams' p99 where 64 had
    # it (2.54 ms against 2.55 in bench_streaming on an H200) and took 340 ms to prefill against 289.
    min_chunk = 64

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_chunk: int | None = None, tiers: KVTiers | None = None):
        self.blocks = block_manager
        self.tiers = tiers
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Places among max_num_seqs held for the samples that running prompts will fork (n > 1):
        # the step that ends such a prompt samples a row for each, and a step samples at most
        # max_num_seqs rows.
        self.reserved = 0
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, hold_loads: bool = True) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """Returns (batch of (sequence, tokens to run)), sequences that can never fit and were
        finished with reason "length"). hold_loads=False runs the prompts that wait for copies from
        a lower tier even when they have not ended (the step then waits for them on the device)."""
        budget = self.max_num_batched_tokens
        # While streams decode, a step that prefills is at most max_prefill_chunk tokens, decode
        # tokens included: the streams' step time stays short, and the step fits the prefill CUDA
        # graph of that size. Prompts keep at least a quarter. With nothing decoding there is
        # nobody to keep waiting, and prompts get the whole batch budget.
        decoding = sum(1 for seq in self.running if seq.num_uncomputed_tokens == 1)
        if decoding:
            prefill_budget = max(self.max_prefill_chunk - decoding, self.max_prefill_chunk // 4, 1)
        else:
            prefill_budget = budget
        batch: list[tuple[Sequence, int]] = []
        cut_short: list[Sequence] = []

        blocks, running, tiers = self.blocks, self.running, self.tiers
        awaiting = tiers.awaiting if tiers is not None else None
        held = tiers.held(running, self.waiting) if awaiting and hold_loads else ()
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.num_tokens >= seq.max_num_tokens:  # its last token is being sampled: it is done
                i += 1
                continue
            if held and seq in held:  # its blocks are still being copied from a lower tier
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if n > 1:
                n = min(n, prefill_budget, self._chunk_after(seq.num_computed_tokens, decoding))
                if n <= 0:  # prefill allowance spent: this prompt's next chunk waits a step
                    i += 1
                    continue
            need = blocks.blocks_needed(seq, seq.num_computed_tokens + n)
            if need:  # a decoding sequence needs a block only once every block_size steps
                while need > blocks.num_free_blocks and running[-1] is not seq:
                    self._preempt(running.pop())
                if need > blocks.num_free_blocks:
                    if len(running) == 1:
                        # Alone and still out of room: the cache cannot hold this sequence any longer.
                        cut_short.append(seq)
                    else:
                        self._preempt(running.pop())
                    break
                blocks.grow(seq, seq.num_computed_tokens + n)
            if awaiting and seq in awaiting:
                tiers.runs(seq)
            batch.append((seq, n))
            budget -= n
            if n > 1:  # a decode token's block is registered when its token lands (LLM._settle)
                prefill_budget -= n
                self._register(seq, n)
            i += 1

        while self.waiting and budget > 0 and len(self.running) + self.reserved < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_tokens >= seq.max_num_tokens:
                break  # preempted while its last token was sampled: it ends when that token lands
            if seq.forks and len(self.running) + self.reserved + 1 + len(seq.forks) > self.max_num_seqs:
                break
            hits = self.blocks.lookup_prefix(seq)  # never covers the last token, which must run
            found = []  # host entries holding the blocks after the hits
            if tiers is not None:
                found = tiers.lookup(seq, len(hits))
                if found is FETCHING:
                    break  # some of its blocks are being read from disk: it goes first once they are in
            if hits and not found and self._next_block_is_being_prefilled(seq, hits):
                break
            computed = (len(hits) + len(found)) * self.blocks.block_size
            # Blocks copied back from a lower tier: while this step has other work, the prompt
            # waits for its copies instead of the step waiting for them.
            hold = bool(batch) and tiers is not None and tiers.restores(hits, found)
            n = 0 if hold else min(seq.num_tokens - computed, budget)
            if n > 1:
                n = min(n, prefill_budget, self._chunk_after(computed, decoding))
                if n <= 0:
                    break
            if self.blocks.blocks_needed(seq, computed + n, hits) > self.blocks.num_free_blocks:
                break
            self.waiting.popleft()
            if tiers is not None:
                tiers.admit(seq, hits, found, computed + n, hold=hold, count=seq.num_preemptions == 0)
            else:
                self.blocks.allocate(seq, hits, computed + n)
            seq.num_computed_tokens = computed
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = computed
                self.prompt_tokens += seq.num_prompt_tokens
                self.prefix_hit_tokens += computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.forks:
                seq.forks_reserved = len(seq.forks)
                self.reserved += seq.forks_reserved
            if hold:
                continue
            self._register(seq, n)
            batch.append((seq, n))
            budget -= n
            if n > 1:
                prefill_budget -= n
        return batch, cut_short

    def _next_block_is_being_prefilled(self, seq: Sequence, hits: list[int]) -> bool:
        """Whether a running prompt that holds seq's cached prefix is still prefilling and will
        compute seq's next full block itself: then seq waits for it rather than computing it too.
        That prompt's chunk was cut short by its context (full_chunk_context), leaving budget for
        seq; it is scheduled ahead of seq every step, so seq waits no longer than it would for
        budget. Only checked for a prompt at the head of the queue with a cache hit."""
        k = len(hits)
        size = self.blocks.block_size
        if k >= (seq.num_tokens - 1) // size:
            return False  # the next block is seq's last, which it computes in any case
        tokens = seq.token_ids[k * size:(k + 1) * size]
        for other in self.running:
            # Holding seq's last hit there means the same tokens up to it (the hashes are chained).
            if (other.num_committed_blocks == k and other.block_table[k - 1] == hits[-1]
                    and other.num_uncomputed_tokens > 1 and (k + 1) * size <= other.num_tokens
                    and other.token_ids[k * size:(k + 1) * size] == tokens):
                return True
        return False

    def _register(self, seq: Sequence, n: int) -> None:
        """Makes the full blocks this step computes for seq reusable at once, by the prompts admitted
        after it in this same schedule too (BlockManager.register_scheduled says why that is safe).
        The blocks past seq's computed tokens were never registered, so no prompt admitted earlier
        can have taken one: nobody reads a block that no step has computed."""
        end = seq.num_computed_tokens + n
        if end == len(seq.token_ids) and seq.token_ids[-1] == PENDING_TOKEN:
            end -= 1  # still being sampled: its block is hashed once the token lands (LLM._settle)
        self.blocks.register_scheduled(seq, end)

    def requeue(self, seq: Sequence) -> None:
        """Sends a running sequence back to wait, to recompute its tokens' K/V from the start."""
        self.running.remove(seq)
        self._preempt(seq)

    def _chunk_after(self, context: int, decoding: int) -> int:
        """The most prompt tokens a step may run after `context` computed ones while `decoding`
        streams wait on it (see full_chunk_context)."""
        if not decoding:
            return self.max_num_batched_tokens
        fits = self.max_prefill_chunk * self.full_chunk_context // max(context + self.max_prefill_chunk, 1)
        return max(fits, min(self.min_chunk, self.max_prefill_chunk))

    def _release_forks(self, seq: Sequence) -> None:
        self.reserved -= seq.forks_reserved
        seq.forks_reserved = 0

    def start_forks(self, seq: Sequence, started: list[Sequence]) -> None:
        """seq's prompt has been sampled for all its samples: those of them still going (`started`,
        each holding its first token) wait at the head of the queue, where the prefix cache gives
        each the prompt's full blocks that seq holds; only the last, partial one is computed again."""
        self._release_forks(seq)
        seq.forks = []
        for fork in reversed(started):
            self.waiting.appendleft(fork)

    def _preempt(self, seq: Sequence) -> None:
        self._release_forks(seq)
        if self.tiers is not None:
            self.tiers.forget(seq)
        self.blocks.free_blocks_of(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence wherever it is (running, waiting or mid-prefill) and frees its blocks."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.forks:
            # Its samples had not started: each prefills the prompt itself now, from the prefix
            # cache as far as it holds the prompt.
            self._release_forks(seq)
            self.waiting.extend(f for f in seq.forks if not f.is_finished)
            seq.forks = []
        if self.tiers is not None:
            self.tiers.forget(seq)
        self.blocks.free_blocks_of(seq)
        seq.drop_pending_tokens()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
