import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import collectives
from engine.layers.quantized import quantize
from engine.layers.weights import copy_into, narrow, shape_of


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up the ids in its range and the
    all-reduce assembles the full vectors."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.tp = collectives.current_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.vocab_size = vocab_size
        self.shard_size = (vocab_size + self.tp_size - 1) // self.tp_size
        self.start = self.tp_rank * self.shard_size
        self.end = min(self.start + self.shard_size, vocab_size)
        # Left unwritten but for the last rank's rows past the vocabulary, which no checkpoint
        # fills: every other row is loaded. A CPU start that maps its weights from the cache
        # (engine/checkpoints/weight_cache.py) never touches these pages; zeroing them all made 213
        # of its 482 MB peak (SmolLM2's table and the tied head's own, replaced at once).
        self.weight = nn.Parameter(torch.empty(self.shard_size, dim), requires_grad=False)
        self.weight.data[self.end - self.start:].zero_()

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        rows = shape_of(loaded)[0]
        if rows < self.vocab_size:
            raise ValueError(f"embedding has {rows} rows, config says vocab_size={self.vocab_size}")
        n = self.end - self.start
        copy_into(param.data[:n], narrow(loaded, 0, self.start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        in_range = (ids >= self.start) & (ids < self.end)
        y = F.embedding(torch.where(in_range, ids - self.start, 0), self.weight)
        y = y * in_range.unsqueeze(-1).to(y.dtype)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    quantized = None  # the head in fewer bits, after quantize (engine/layers/quantized.py)
    # Set by the runner with the Triton backend: one-row steps take the Triton GEMV, which read
    # Qwen3-0.6B's 311 MB head in 100 µs against cuBLAS's 111 (H100, in a CUDA graph). More rows were
    # not measured.
    fused = False

    # How many of each row's largest logits the quantized head recomputes in float32. Over 195
    # greedy steps of SmolLM2 on six chat prompts, float32's leader ranked at most third in the
    # int4 head's order and second in the int8 head's.
    LEADERS = 16

    def quantize(self, method: str, tied: bool, prebuilt=None) -> None:
        """A quantized copy of the head for the logits (or prebuilt, as quantized.quantize takes it);
        a tied table stays float for the embedding's lookups (one row a token, so its bytes barely
        count)."""
        self.quantized = quantize(self.weight.data, method, prebuilt)
        if not tied:
            self.weight = None
        elif hasattr(self.quantized, "precise_activations"):
            # The float table settles the leaders (_recompute_leaders): the rest only rank them.
            self.quantized.precise_activations = False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on rank 0 (None elsewhere)."""
        if self.quantized is not None:
            # Through the kernel at any row count: expanded to float32 (quantized.py), SmolLM2's head
            # would hold 113 MB in the expansion buffer from then on.
            rows = hidden.reshape(-1, hidden.shape[-1])
            logits = self.quantized.kernel_product(rows).to(hidden.dtype).view(*hidden.shape[:-1], -1)
            if self.tp_size == 1:
                self._recompute_leaders(hidden, logits)
        elif self.fused and hidden.dim() == 2 and hidden.shape[0] == 1 and hidden.stride(1) == 1:
            from kernels.gemv import (
                gemv,  # start-up: Triton loads only where its kernels run
            )
            logits = gemv(hidden, self.weight)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = self.tp.gather_to_rank0(logits, dim=-1)
            if logits is None:
                return None
        return logits[..., : self.vocab_size]

    def _recompute_leaders(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Recomputes each row's largest logits in float32, from the float table where the head is
        tied to the embedding (which keeps it) and from the quantized rows otherwise. The quantized
        kernels write bf16, where a logit near 25 is a multiple of 0.125: close leaders tie or swap.
        For "What is the capital of France?" SmolLM2's "The" and "L'" are 0.08 apart in float32 and
        tied in bf16, where argmax took "L'". Greedy decoding then picks float32's leader wherever
        it is among the quantized head's LEADERS largest; sampling sees the other logits as the
        quantized head rounds them."""
        top = logits.topk(min(self.LEADERS, logits.shape[-1]), dim=-1).indices  # [rows, leaders]
        weight = self.weight[top] if self.weight is not None else self.quantized.rows(top)
        exact = torch.matmul(weight, hidden.to(weight.dtype).unsqueeze(-1)).squeeze(-1)
        logits.scatter_(-1, top, exact.to(logits.dtype))
