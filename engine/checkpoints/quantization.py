"""A checkpoint's `quantization_config`: the block-wise FP8 format of Qwen's FP8 releases is read;
any other method is refused by name before anything is loaded.

Block FP8 (`quant_method: fp8` with `weight_block_size`): each projection's weight is e4m3 with a
float32 `weight_scale_inv` per [block_n, block_k] tile, weight = q * scale (the scale of a tile
multiplies, despite its name). On CUDA the weights stay in FP8 (engine/layers/fp8.py); elsewhere,
or with quantization="none", `dequantized` turns each (weight, scale) pair into one float weight
as the tensors stream in."""
from engine.checkpoints.errors import ModelError
from engine.layers import fp8
from engine.layers.weights import materialize

_SCALE_SUFFIX = "_scale_inv"


def fp8_block(quantization_config: dict | None, where: str) -> tuple[int, int] | None:
    """The [block_n, block_k] of a block-FP8 checkpoint, None for an unquantized one; a ModelError
    naming the method for anything else."""
    if not quantization_config:
        return None
    qc = quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else dict(quantization_config)
    method = qc.get("quant_method", "unknown")
    if method != "fp8":
        raise ModelError(f"{where}: the checkpoint is quantized with {method!r}, which nvchat does not load; it reads "
                         "unquantized (bf16/fp16/fp32) checkpoints and block-wise FP8 ones (quant_method 'fp8' "
                         "with weight_block_size, as Qwen's FP8 releases)")
    block = qc.get("weight_block_size")
    if not block:
        raise ModelError(f"{where}: an FP8 checkpoint without weight_block_size (per-tensor or per-channel "
                         "scales) is not supported; nvchat reads block-wise FP8 (weight_block_size [128, 128])")
    if len(block) != 2 or any(not isinstance(b, int) or b < 1 or b & (b - 1) for b in block):
        raise ModelError(f"{where}: weight_block_size {block} is not two powers of two")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ModelError(f"{where}: FP8 format {qc['fmt']!r} is not supported; nvchat reads e4m3")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelError(f"{where}: activation_scheme {qc['activation_scheme']!r} (static input scales) is not "
                         "supported; nvchat quantizes activations dynamically")
    return tuple(block)


def dequantized(weights, block: tuple[int, int]):
    """(file name, checkpoint name, tensor) as load_weights takes them, with each FP8 weight and its
    `weight_scale_inv` replaced by one float32 weight under the weight's name. A pair is usually
    adjacent; when not, the first of the two waits, read into memory."""
    waiting: dict[str, tuple] = {}  # weight name -> (file, the weight or its scales read so far, which)
    for source, name, tensor in weights:
        if name.endswith(_SCALE_SUFFIX):
            base, is_scale = name[:-len(_SCALE_SUFFIX)], True
        elif fp8.is_fp8(tensor):
            base, is_scale = name, False
        else:
            yield source, name, tensor
            continue
        if base not in waiting:
            waiting[base] = (source, materialize(tensor), is_scale)
            continue
        _, other, other_is_scale = waiting.pop(base)
        if other_is_scale == is_scale:
            raise ModelError(f"{source}: {name} appears twice")
        q, scale = (other, materialize(tensor)) if is_scale else (materialize(tensor), other)
        yield source, base, fp8.dequantize_blocks(q, scale, block)
    for base, (source, _, is_scale) in waiting.items():
        if is_scale:
            raise ModelError(f"{source}: {base}{_SCALE_SUFFIX} has no FP8 weight {base} beside it")
        raise ModelError(f"{source}: {base} is FP8 but has no {base.rpartition('.')[2]}{_SCALE_SUFFIX} "
                         "(its block scales) beside it")
