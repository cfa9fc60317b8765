"""Tensor-parallel group of this process: rank, size and the collectives the layers need.

With one rank everything here is a no-op, so single-GPU and CPU runs pay nothing for it.
"""
import torch
import torch.distributed as dist

_rank = 0
_size = 1


def set_tp_group(rank: int, size: int) -> None:
    global _rank, _size
    _rank, _size = rank, size


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _size > 1:
        dist.all_reduce(x)
    return x


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenates each rank's shard along dim on rank 0; other ranks get None."""
    if _size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size)] if _rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=dim) if _rank == 0 else None
