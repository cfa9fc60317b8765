"""Weight-only quantization for CPU (`LLM(..., quantization="int8" | "int4")`): the projections
(and the LM head, in int8: CausalLM.quantize) keep their weights in fewer bits. A step of a few
rows (decode) multiplies through torch's CPU kernels for them, with bf16 activations, reading a
quarter (int8) or an eighth (int4) of float32's bytes. A step of many rows (a prompt) is bound by
arithmetic instead, where those kernels lose to float32's GEMM (int4 took 1.9x float32's time to a
1,490-token prompt's first token): there the layer's weight is expanded back to float32, into a
buffer the next layer reuses, for float32's GEMM. The logits move away from the float model's by
the rounding: not bit-exact against HF.

- int8: symmetric, one scale per output row. Where the C kernels build the weight is kept in their
  blocks and multiplies through them (NativeInt8Weight, for rows in multiples of 32 values);
  elsewhere through torch's int8 kernel (Int8Weight).
- int4: asymmetric, a scale and a minimum per 32 weights of a row, as GGUF's Q4_1 stores them, so
  a Q4_1 file's projections come back on their own grid. Where the C kernel builds
  (engine/layers/native_cpu.py: x86-64 with AVX2 and a C compiler) the weight keeps Q4_1's own
  layout and multiplies through it (Q4_1Weight); elsewhere through torch's int4 kernel, in its
  packing, with the scales in bf16 (Int4Weight)."""
import functools

import torch
import torch.nn.functional as F

from engine.layers import native_cpu

INT4_GROUP = 32


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: weight ~= q * scales[:, None]."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(torch.bfloat16)


def _kernel_rows(x: torch.Tensor) -> torch.Tensor:
    # The kernels want 2-D contiguous bf16 activations; with float32 ones the int8 kernel is ~5x
    # slower and the int4 one needs float32 scales and runs unvectorized.
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    if x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    return x if x.is_contiguous() else x.contiguous()


def _native_rows(x: torch.Tensor) -> torch.Tensor:
    # The C kernels want 2-D contiguous float32 activations.
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    if x.dtype != torch.float32:
        x = x.float()
    return x if x.is_contiguous() else x.contiguous()


class _QuantizedWeight:
    method: str  # quantize's name for it
    out_features: int
    in_features: int
    # Rows from which a product expands the weight to float32 instead of running the quantized
    # kernel, whose time grows with the rows while the expansion's is mostly fixed. On the 2-core
    # box (one thread, SmolLM2's four projections, CPU ms a layer): int4's kernel against its
    # expansion 6.7 / 12.0 at 32 rows, 19.0 / 18.0 at 96, 26.7 / 20.9 at 128; int8's 7.2 / 7.9 at 32,
    # 13.3 / 11.0 at 64.
    expanded_rows: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T in x's dtype and shape."""
        y = self.product(x.reshape(-1, x.shape[-1]))
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ weight.T: with fewer than expanded_rows rows through the quantized kernel,
        in bf16; with more through the weight expanded to float32, in float32 (or x's dtype, if
        wider). Callers that keep float32 add its bf16 to theirs, which promotes exactly."""
        if x.shape[0] < self.expanded_rows:
            return self.kernel_product(x)
        weight = self.expanded()
        return F.linear(x.to(torch.promote_types(x.dtype, weight.dtype)), weight)

    def kernel_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ weight.T through the quantized kernel at any row count, in bf16."""
        return self._kernel_product(_kernel_rows(x))

    @property
    def shape(self) -> tuple[int, int]:
        """The float weight's [out, in]."""
        return self.out_features, self.in_features

    @staticmethod
    def tensor_specs(out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The tensors a weight of [out, in] is made of: {name: (shape, dtype)}."""
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        """Everything the weight is made of, by name, for a cache (engine/checkpoints/weight_cache.py)."""
        return {name: getattr(self, name) for name in self.tensor_specs(self.out_features, self.in_features)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], shape: tuple[int, int]):
        """The weight of shape [out, in] that tensors() gave, taken as they are (no copy); a
        ValueError where a tensor is missing, extra or not the shape and dtype it must be."""
        out_features, in_features = shape
        specs = cls.tensor_specs(out_features, in_features)
        if set(tensors) != set(specs):
            raise ValueError(f"{cls.method} weight needs tensors {sorted(specs)}, got {sorted(tensors)}")
        for name, (size, dtype) in specs.items():
            t = tensors[name]
            if tuple(t.shape) != size or t.dtype != dtype:
                raise ValueError(f"{cls.method} {name} of a [{out_features}, {in_features}] weight must be "
                                 f"{list(size)} {dtype}, got {list(t.shape)} {t.dtype}")
        weight = cls.__new__(cls)
        weight.out_features, weight.in_features = out_features, in_features
        for name, t in tensors.items():
            setattr(weight, name, t)
        return weight


class Int8Weight(_QuantizedWeight):
    method = "int8"
    expanded_rows = 64

    def __init__(self, weight: torch.Tensor):
        self.q, self.scales = quantize_rows(weight)
        self.out_features, self.in_features = self.q.shape

    @staticmethod
    def tensor_specs(out_features: int, in_features: int) -> dict:
        return {"q": ((out_features, in_features), torch.int8), "scales": ((out_features,), torch.bfloat16)}

    def _kernel_product(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.q, self.scales)

    def expanded(self) -> torch.Tensor:
        """The weight in float32, [out, in], in the shared expansion buffer (see Int4Weight's)."""
        w = _expansion_buffer(self.q.numel()).view(self.q.shape)
        return w.copy_(self.q).mul_(self.scales.float()[:, None])

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The weight's rows at index (any shape), in float32: [*index.shape, in]."""
        return torch.mul(self.q[index], self.scales[index].float().unsqueeze(-1))


class NativeInt8Weight(_QuantizedWeight):
    """int8 with a scale per row (quantize_rows' values, the scales in float32), multiplied by the C
    kernel (engine/layers/native/quantized_gemv.c): rows in blocks of four, each block's groups of
    32 values side by side (q [blocks, groups, 4, 32]), the last block padded with zero rows. The
    kernel takes the activations in two int8 parts, or with precise_activations off in one, as
    Q4_1Weight's; the product is float32."""
    method = "int8"
    precise_activations = True  # as Q4_1Weight's
    # As Q4_1Weight's. SmolLM2's four projections, one thread, AVX2 box, ms a layer, kernel against
    # expansion: 0.25 / 2.1 at 1 row, 6.4 / 6.2 at 32, 9.9 / 10.6 at 48, 15.0 / 11.8 at 64.
    expanded_rows = 48

    def __init__(self, weight: torch.Tensor):
        rows, cols = weight.shape
        if cols % INT4_GROUP:
            raise ValueError(f"the int8 kernel needs input features in multiples of {INT4_GROUP}, this layer has {cols}")
        q, scales = quantize_rows(weight)
        self.out_features, self.in_features = rows, cols
        padded = rows + (-rows % 4)
        q = F.pad(q, (0, 0, 0, padded - rows)).view(padded, cols // INT4_GROUP, INT4_GROUP)
        self.q = _blocked(q, padded // 4)
        self.scales = F.pad(scales.float(), (0, padded - rows))

    @staticmethod
    def tensor_specs(out_features: int, in_features: int) -> dict:
        blocks = -(-out_features // 4)
        return {"q": ((blocks, in_features // INT4_GROUP, 4, INT4_GROUP), torch.int8),
                "scales": ((blocks * 4,), torch.float32)}

    def kernel_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ weight.T through the C kernel at any row count, in float32."""
        return native_cpu.q8_product(_native_rows(x), self.q, self.scales, self.out_features,
                                     two_parts=self.precise_activations)

    def by_row(self) -> torch.Tensor:
        """The int8 values [out, in], row by row."""
        blocks, groups = self.q.shape[:2]
        return self.q.transpose(1, 2).reshape(blocks * 4, groups * INT4_GROUP)[:self.out_features]

    def expanded(self) -> torch.Tensor:
        """The weight in float32, [out, in], in the shared expansion buffer (see Int4Weight's)."""
        w = _expansion_buffer(self.out_features * self.in_features).view(self.out_features, self.in_features)
        return w.copy_(self.by_row()).mul_(self.scales[:self.out_features, None])

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The weight's rows at index (any shape), in float32: [*index.shape, in]."""
        block, within = index // 4, index % 4
        q = self.q[block, :, within].flatten(-2)
        return torch.mul(q, self.scales[index].unsqueeze(-1))


class Int4Weight(_QuantizedWeight):
    method = "int4"
    expanded_rows = 96

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        q, scale, low = _int4_grid(weight, 16)  # the packing kernel takes rows in multiples of 16
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).view(q.shape[0], -1), 1)
        # The kernel computes (q - 8) * scale + zero: zero is the group's value at q = 8.
        self.scales_and_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)

    @staticmethod
    def tensor_specs(out_features: int, in_features: int) -> dict:
        padded = out_features + (-out_features % 16)
        return {"packed": ((padded, in_features // 2), torch.uint8),
                "scales_and_zeros": ((in_features // INT4_GROUP, padded, 2), torch.bfloat16)}

    def _kernel_product(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_and_zeros)
        return y if y.shape[1] == self.out_features else y[:, :self.out_features]

    def expanded(self) -> torch.Tensor:
        """The weight in float32, [out, in], as the kernel sees it: (q - 8) * scale + zero. Written
        into the shared expansion buffer: valid until the next expansion."""
        rows = self.packed.shape[0]
        w = _expansion_buffer(rows * self.in_features).view(rows, -1, INT4_GROUP)
        w.copy_(unpack_int4(self.packed, rows, self.in_features).view(rows, -1, INT4_GROUP))
        scales = self.scales_and_zeros.float().permute(1, 0, 2).contiguous()  # [rows, groups, (scale, zero)]
        scale, zero = scales[..., :1], scales[..., 1:]
        w.mul_(scale).add_(zero - 8 * scale)
        return w.view(rows, -1)[:self.out_features]


class Q4_1Weight(_QuantizedWeight):
    """int4 in GGUF's Q4_1 form, multiplied by the C kernel (engine/layers/native/quantized_gemv.c): per
    row and group of 32, 16 bytes of nibbles (value j low, value j + 16 high in byte j) and a
    float16 scale and minimum (as Q4_1 stores them), w = scale * q + minimum; rows in blocks of four, each block's groups
    side by side (nibbles [blocks, groups, 4, 16], scales and minimums [blocks, groups, 4]), the
    last block padded with zero rows. The kernel takes the activations to 2^-16 of each group's
    largest value (two int8 parts), or, with precise_activations off, to one int8 each; the product
    is float32."""
    method = "int4"
    # Off for a product whose largest results are computed again in float (a tied LM head's
    # leaders, ParallelLMHead): one int8 an activation is ~1.5x faster.
    precise_activations = True
    # The kernel's time grows with the rows, the expansion's (float32 GEMM) much less: SmolLM2's four
    # projections, one thread, AVX2 box, ms a layer, kernel against expansion: 0.34 / 6.2 at 1 row,
    # 5.9 / 12.7 at 16, 11.3 / 14.9 at 32, 17.0 / 17.7 at 48, 30.0 / 18.1 at 96.
    expanded_rows = 48

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        q, scale, low = _int4_grid(weight, 4)
        scale[self.out_features:], low[self.out_features:] = 0.0, 0.0
        blocks = q.shape[0] // 4
        self.nibbles = _blocked(q[..., :16] | (q[..., 16:] << 4), blocks)
        self.scales, self.minimums = _blocked(scale.half(), blocks), _blocked(low.half(), blocks)

    @staticmethod
    def tensor_specs(out_features: int, in_features: int) -> dict:
        blocks, groups = -(-out_features // 4), in_features // INT4_GROUP
        return {"nibbles": ((blocks, groups, 4, 16), torch.uint8),
                "scales": ((blocks, groups, 4), torch.float16),
                "minimums": ((blocks, groups, 4), torch.float16)}

    def by_row(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The nibbles [out, groups, 16], scales and minimums [out, groups], row by row."""
        def rows(t):
            return t.transpose(1, 2).reshape(-1, *t.shape[1:2], *t.shape[3:])[:self.out_features]
        return rows(self.nibbles), rows(self.scales), rows(self.minimums)

    def kernel_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] @ weight.T through the C kernel at any row count, in float32."""
        return native_cpu.q4_1_product(_native_rows(x), self.nibbles, self.scales, self.minimums, self.out_features,
                                       two_parts=self.precise_activations)

    def expanded(self) -> torch.Tensor:
        """The weight in float32, [out, in], as the kernel sees it, in the shared expansion buffer
        (see Int4Weight's)."""
        blocks, groups = self.nibbles.shape[:2]
        w = _expansion_buffer(blocks * 4 * self.in_features).view(blocks, 4, groups, INT4_GROUP).transpose(1, 2)
        w[..., :16].copy_(self.nibbles & 15)
        w[..., 16:].copy_(self.nibbles >> 4)
        w.mul_(self.scales[..., None].float()).add_(self.minimums[..., None].float())
        return _expansion_buffer(blocks * 4 * self.in_features).view(blocks * 4, -1)[:self.out_features]


def _int4_grid(weight: torch.Tensor, row_multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] on Q4_1's grid, its rows padded with zeros to a multiple of row_multiple:
    the values q [padded, groups, 32] (uint8, 0..15), and each group's scale and minimum [padded,
    groups] (float32), w ~= scale * q + minimum."""
    rows, cols = weight.shape
    if cols % INT4_GROUP:
        raise ValueError(f"int4 needs input features in multiples of {INT4_GROUP}, this layer has {cols}")
    padded = rows + (-rows % row_multiple)
    w = F.pad(weight.float(), (0, 0, 0, padded - rows)).view(padded, cols // INT4_GROUP, INT4_GROUP)
    low = w.amin(-1)
    scale = ((w.amax(-1) - low) / 15).clamp(min=1e-12)
    return torch.round((w - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8), scale, low


def _blocked(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """[blocks * 4, groups, ...] by row -> [blocks, groups, 4, ...], a block's groups side by side."""
    return t.view(blocks, 4, *t.shape[1:]).transpose(1, 2).contiguous()


def int4_class() -> type:
    """The int4 weight this machine multiplies fastest: Q4_1Weight where the C kernel builds."""
    return Q4_1Weight if native_cpu.native_q4_1() is not None else Int4Weight


def int8_class(in_features: int) -> type:
    """The int8 weight this machine multiplies fastest for rows of in_features values:
    NativeInt8Weight where the C kernels build and the rows are whole groups of 32."""
    return NativeInt8Weight if native_cpu.native_kernels() is not None and in_features % INT4_GROUP == 0 else Int8Weight


_expansion = torch.empty(0)


def _expansion_buffer(numel: int) -> torch.Tensor:
    """A float32 buffer for one expanded weight, kept from one product to the next: a fresh one
    for each layer of a prompt cost more in page faults than its arithmetic (7 MB a layer for
    SmolLM2's MLP; ~5 ms of the ~7 ms an expansion took on the 2-core box)."""
    global _expansion
    if _expansion.numel() < numel:
        _expansion = torch.empty(numel)
    return _expansion[:numel]


@functools.cache
def _int4_layout() -> tuple[int, bool]:
    """How this torch build's CPU packing orders a weight's rows, which varies with the CPU's
    vector width: (rows a block, whether each byte pairs neighbouring rows of a block rather than
    row i with row i + half the block). Found by unpacking a packed probe every known way."""
    probe = torch.randint(0, 16, (176, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch._convert_weight_to_int4pack_for_cpu(probe, 1)
    for layout in ((64, False), (32, False), (32, True)):
        if torch.equal(_unpack_int4(packed, *probe.shape, *layout), probe.to(torch.uint8)):
            return layout
    raise RuntimeError(f"torch {torch.__version__} packs int4 weights in a layout nvchat does not know; "
                       "use quantization='int8' or 'none'")


def unpack_int4(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The 4-bit values [rows, cols] (uint8) of torch._convert_weight_to_int4pack_for_cpu's output."""
    return _unpack_int4(packed, rows, cols, *_int4_layout())


def _unpack_int4(packed: torch.Tensor, rows: int, cols: int, block: int, pairs: bool) -> torch.Tensor:
    # The packing (aten/src/ATen/native/cpu/int4mm_kernel.cpp) takes rows in blocks of `block`,
    # stores each block as [cols, block / 2] bytes, two rows' values a byte (low nibble first),
    # and a last, shorter block always in pairs. The bytes are turned to rows of cols first: a
    # byte is half the copy of a value.
    flat = packed.view(-1)
    full = rows // block * block
    out = torch.empty(rows, cols, dtype=torch.uint8)
    for start, size, blocks, paired in ((0, block, rows // block, pairs), (full, rows - full, 1, True)):
        if blocks == 0 or size == 0:
            continue
        count = blocks * size
        b = flat[start * cols // 2:(start + count) * cols // 2].view(blocks, cols, size // 2).transpose(1, 2)
        b = b.contiguous()  # [blocks, size / 2, cols]
        # Row 2i is byte i's low nibble and 2i + 1 its high one, or row i low and i + size / 2 high.
        rows_of = out[start:start + count].view(blocks, size // 2, 2, cols) if paired else \
            out[start:start + count].view(blocks, 2, size // 2, cols).transpose(1, 2)
        torch.bitwise_and(b, 15, out=rows_of[:, :, 0])
        torch.bitwise_right_shift(b, 4, out=rows_of[:, :, 1])
    return out


def quantize(weight: torch.Tensor, method: str, prebuilt: _QuantizedWeight | None = None):
    """A callable x -> x @ weight.T, in `method`'s bits. prebuilt: that callable made before, as a
    cache holds it (engine/checkpoints/weight_cache.py), taken instead of quantizing weight, whose
    values are not read; a ValueError if it is not in method's bits and weight's shape."""
    if prebuilt is None:
        return {"int8": int8_class(weight.shape[1]), "int4": int4_class()}[method](weight)
    if prebuilt.method != method or prebuilt.shape != tuple(weight.shape):
        raise ValueError(f"a prebuilt {prebuilt.method} weight of shape {list(prebuilt.shape)} can't stand for a "
                         f"{method} one of shape {list(weight.shape)}")
    return prebuilt
