"""Helpers for weight loaders: a loaded weight is a torch tensor or a lazy safetensors slice, and a
loader narrows it to this rank's part before anything is read from disk."""
import torch


def shape_of(loaded) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def narrow(loaded, dim: int, start: int, size: int):
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    index = [slice(None)] * len(loaded.get_shape())
    index[dim] = slice(start, start + size)
    return loaded[tuple(index)]


def materialize(loaded) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def copy_into(param: torch.Tensor, loaded) -> None:
    tensor = materialize(loaded)
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
    param.data.copy_(tensor)


def default_weight_loader(param: torch.Tensor, loaded) -> None:
    copy_into(param, loaded)
