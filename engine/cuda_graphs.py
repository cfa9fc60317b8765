"""CUDA graphs for decode steps.

A decode step launches a few hundred small kernels; replaying a captured graph removes their
launch gaps. One graph per batch size bucket, captured over static input buffers sized for
max_num_seqs and for block tables as wide as max_model_len needs. A batch runs in the smallest
bucket that holds it; padding rows write no K/V (slot -1) and their outputs are ignored.
"""
import torch

from engine.layers.attention import AttentionMetadata


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model, max_batch: int, max_blocks_per_seq: int, hidden_size: int, device, dtype):
        self.model = model
        self.buckets = batch_buckets(max_batch)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:b], context_lens=self.context_lens[:b],
                                 block_tables=self.block_tables[:b], cu_seqlens_q=self.cu_seqlens_q[:b + 1],
                                 max_seqlen_q=1, is_decode=True)

    def _forward(self, b: int) -> None:
        self.hidden[:b] = self.model(self.input_ids[:b], self.positions[:b], self._meta(b))

    @torch.inference_mode()
    def capture(self, progress=None) -> None:
        pool = None
        # Largest first, so the shared memory pool is sized once and smaller graphs fit inside it.
        for i, b in enumerate(reversed(self.buckets)):
            if progress and i % 8 == 0:
                progress(f"capturing CUDA graphs ({i}/{len(self.buckets)})")
            self._forward(b)  # warm up: lazy inits and autotuning stay out of the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def fits(self, batch: int) -> bool:
        return batch <= self.buckets[-1]

    @torch.inference_mode()
    def run(self, input_ids, positions, slot_mapping, context_lens, block_tables) -> torch.Tensor:
        """Inputs are device tensors for a batch of B decode tokens; returns hidden states [B, H]."""
        b = input_ids.shape[0]
        bucket = next(size for size in self.buckets if size >= b)
        self.input_ids[:b] = input_ids
        self.positions[:b] = positions
        self.slot_mapping[:b] = slot_mapping
        self.slot_mapping[b:bucket] = -1
        self.context_lens[:b] = context_lens
        self.context_lens[b:bucket] = 1
        width = block_tables.shape[1]
        self.block_tables[:b, :width] = block_tables
        self.graphs[bucket].replay()
        return self.hidden[:b]
