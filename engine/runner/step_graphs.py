"""CUDA graphs for engine steps.

A step launches a few hundred small kernels; on a busy host their launch cost, not the GPU,
sets the step time. Replaying a captured graph removes it. Graphs are captured per bucket of
step sizes over static input buffers, and a step runs in the smallest bucket that holds it:
padding tokens write no K/V (slot -1), padding sequences have no queries, and their outputs are
ignored.

StepGraphs holds the small prefill or mixed steps (bucketed by token count), which is what a chat
turn after a cached prefix and a prompt chunk mixed into decoding streams look like. Decode steps
(one query per sequence, bucketed by batch size) have their own, leaner feed: engine.runner.decode_graphs.
"""
import torch

from engine.layers.attention import AttentionMetadata


def decode_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def capture_graph(run, pool=None) -> torch.cuda.CUDAGraph:
    """Captures run() into a graph drawing on pool (a graph's pool() to share one)."""
    run()  # warm up: lazy inits and Triton compiles stay out of the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool):
        run()
    return graph


def prefill_buckets(max_tokens: int) -> list[int]:
    return [t for t in (32, 64, 128, 256, 512, 768, 1024) if t <= max_tokens]


class StepGraphs:
    def __init__(self, model, *, token_buckets: list[int], max_seqs: int, max_blocks_per_seq: int,
                 hidden_size: int, device, dtype):
        self.model = model
        self.buckets = token_buckets
        self.max_seqs = max_seqs
        tokens = token_buckets[-1]
        seqs = self.seqs_in(tokens)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        # The prefill kernel's work list (kernels.prefill_attention), refilled every replay: the
        # captured kernel runs the step's own tiles and splits, whatever the bucket. Rows bound any
        # step's items: at most a tile per query token or sequence, times the split cap.
        # start-up: Triton and its kernels (0.3 s of a CPU start's imports) only where graphs run
        from kernels.prefill_attention import ITEM_FIELDS, split_cap
        self.work_items = torch.zeros((tokens + seqs) * split_cap(token_buckets[0]), ITEM_FIELDS,
                                      dtype=torch.int32, device=device)
        self.work_count = torch.zeros(1, dtype=torch.int32, device=device)
        self.token_splits = torch.zeros(tokens, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(tokens, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def seqs_in(self, tokens: int) -> int:
        """Sequences a bucket holds: a capped number, since every sequence slot costs attention
        programs that exit at once."""
        return min(tokens, self.max_seqs)

    def bucket_for(self, tokens: int, seqs: int) -> int | None:
        return next((t for t in self.buckets if t >= tokens and self.seqs_in(t) >= seqs), None)

    def _meta(self, tokens: int) -> AttentionMetadata:
        from kernels.prefill_attention import PrefillWork, split_cap  # start-up: as in __init__
        s = self.seqs_in(tokens)
        work = PrefillWork(self.work_items, self.work_count, self.token_splits[:tokens], split_cap(tokens))
        return AttentionMetadata(slot_mapping=self.slot_mapping[:tokens], context_lens=self.context_lens[:s],
                                 block_tables=self.block_tables[:s], cu_seqlens_q=self.cu_seqlens_q[:s + 1],
                                 max_seqlen_q=tokens, is_decode=False, prefill_work=work)

    def _forward(self, tokens: int) -> None:
        self.hidden[:tokens] = self.model(self.input_ids[:tokens], self.positions[:tokens], self._meta(tokens))

    @torch.inference_mode()
    def rehearse(self) -> None:
        """Runs each step capture() would capture once, eagerly (ModelRunner._compile_ahead)."""
        for tokens in self.buckets:
            self._forward(tokens)

    @torch.inference_mode()
    def capture(self, pool=None, progress=None):
        """Captures every bucket, largest first so the shared memory pool is sized once. Returns
        the pool, which another StepGraphs may share (steps never run at the same time)."""
        for i, tokens in enumerate(reversed(self.buckets)):
            if progress and i % 8 == 0:
                progress(f"capturing prefill CUDA graphs ({i}/{len(self.buckets)})")
            self.graphs[tokens] = graph = capture_graph(lambda: self._forward(tokens), pool)
            pool = graph.pool()
        # A graph's first launch also uploads it to the device: a prompt's last, small chunk took
        # 6-7 ms instead of ~2.5 in a bucket not yet replayed (H200, bench_streaming). Launch each
        # once now, on the capture's own buffers: every slot is -1, so no K/V is written.
        for graph in self.graphs.values():
            graph.replay()
        torch.cuda.synchronize()
        return pool

    @torch.inference_mode()
    def run(self, bucket: int, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Copies a step's device tensors into the bucket's buffers, replays, returns [bucket, H]:
        the step's tokens first, then the padding's rows: unused, and holding anything (the prefill
        attention leaves them unwritten), NaN and infinities included."""
        t, b = input_ids.shape[0], meta.context_lens.shape[0]
        s = self.seqs_in(bucket)
        self.input_ids[:t] = input_ids
        self.positions[:t] = positions
        self.slot_mapping[:t] = meta.slot_mapping
        if t < bucket:
            self.slot_mapping[t:bucket] = -1
        self.context_lens[:b] = meta.context_lens
        self.block_tables[:b, :meta.block_tables.shape[1]] = meta.block_tables
        self.context_lens[b:s] = 0
        self.cu_seqlens_q[:b + 1] = meta.cu_seqlens_q
        self.cu_seqlens_q[b + 1:s + 1] = t  # padding sequences: no queries
        work = meta.prefill_work
        if work is not None:
            self.work_items[:work.items.shape[0]] = work.items
            self.work_count.copy_(work.count)
            self.token_splits[:t] = work.token_splits
            self.token_splits[t:bucket] = 0
        self.graphs[bucket].replay()
        return self.hidden[:bucket]
