"""Sampling adjustments for a batch of rows in two launches: token masks, repetition, frequency and
presence penalties over every logit, then each row's logit_bias entries and banned tokens.

The decode graphs' adjusted sampling (engine/runner/decode_graphs.py) needs, per row, its logits
with logit_bias added, tokens outside its structured-output mask at -inf, its banned tokens at
-inf unless that would leave it no token, and the penalties from its token counts. As torch
operations that is some twenty passes over rows x vocabulary; here the first kernel reads each
row's logits, mask words and counts once and writes the result, and the second touches only the
few tokens a row's bias or bans name.

The bias comes before the penalties (SamplingParams' order), so the first kernel leaves biased
tokens as unbiased ones and the second recomputes those from the logits with the bias added. A
finite bias never makes a token finite or infinite, so whether a row keeps a token after its bans
does not depend on it.

Arithmetic matches the torch operations' rounding: divisions round to nearest and no multiply is
fused into the subtraction after it.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _adjusted(x, tokens, mask_words_ptr, counts_ptr, seen_ptr, use_mask, use_counts, repetition, frequency,
              presence, valid):
    """One row's logits x at `tokens` after its mask and penalties."""
    if use_mask:
        words = tl.load(mask_words_ptr + tokens // 32, mask=valid, other=-1)
        allowed = ((words >> (tokens % 32)) & 1) != 0
        x = tl.where(allowed, x, float("-inf"))
    if use_counts:
        counts = tl.load(counts_ptr + tokens, mask=valid, other=0)
        in_completion = counts > 0
        seen = (tl.load(seen_ptr + tokens, mask=valid, other=0) != 0) | in_completion
        scaled = tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition)
        x = tl.where(seen, scaled, x)
        x = x - frequency * counts.to(tl.float32)
        x = x - presence * in_completion.to(tl.float32)
    return x


@triton.jit
def _mask_and_penalize_kernel(logits_ptr, out_ptr, slot_ptr, mask_row_ptr, masks_ptr, counts_ptr, seen_ptr,
                              repetition_ptr, frequency_ptr, presence_ptr, vocab, logits_stride, mask_stride,
                              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = tokens < vocab
    slot = tl.load(slot_ptr + row)
    mask_row = tl.load(mask_row_ptr + row)
    x = tl.load(logits_ptr + row * logits_stride + tokens, mask=valid, other=0.0).to(tl.float32)
    x = _adjusted(x, tokens, masks_ptr + mask_row * mask_stride, counts_ptr + slot * vocab, seen_ptr + slot * vocab,
                  mask_row != 0, slot != 0, tl.load(repetition_ptr + row), tl.load(frequency_ptr + row),
                  tl.load(presence_ptr + row), valid)
    tl.store(out_ptr + row * vocab + tokens, x, mask=valid)


@triton.jit
def _bias_and_bans_kernel(logits_ptr, out_ptr, slot_ptr, mask_row_ptr, masks_ptr, counts_ptr, seen_ptr,
                          repetition_ptr, frequency_ptr, presence_ptr, bias_ids_ptr, bias_values_ptr, banned_ptr,
                          ban_ptr, vocab, logits_stride, mask_stride, BIAS: tl.constexpr, BANS: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row)
    out_row = out_ptr + row * vocab
    if slot != 0:  # slot 0 holds no bias
        entries = tl.arange(0, BIAS)
        ids = tl.load(bias_ids_ptr + slot * BIAS + entries)
        values = tl.load(bias_values_ptr + slot * BIAS + entries)
        # A token named twice gets the sum of its entries, as a scatter-add gives it; each of its
        # entries then stores the same value.
        same = ids[:, None] == ids[None, :]
        total = tl.sum(tl.where(same, values[None, :], 0.0), axis=1)
        biased = (total != 0.0) & (ids < vocab)
        mask_row = tl.load(mask_row_ptr + row)
        x = tl.load(logits_ptr + row * logits_stride + ids, mask=biased, other=0.0).to(tl.float32) + total
        x = _adjusted(x, ids, masks_ptr + mask_row * mask_stride, counts_ptr + slot * vocab,
                      seen_ptr + slot * vocab, mask_row != 0, True, tl.load(repetition_ptr + row),
                      tl.load(frequency_ptr + row), tl.load(presence_ptr + row), biased)
        tl.store(out_row + ids, x, mask=biased)
    if tl.load(ban_ptr + row) != 0:
        bans = tl.arange(0, BANS)
        banned = tl.load(banned_ptr + row * BANS + bans)
        # Bans that would leave the row no finite token are not applied (the eager Sampler keeps
        # the end of the reply then).
        kept = tl.zeros((BLOCK,), dtype=tl.int32)
        for start in range(0, vocab, BLOCK):
            tokens = start + tl.arange(0, BLOCK)
            x = tl.load(out_row + tokens, mask=tokens < vocab, other=float("-inf"))
            is_banned = tl.max((tokens[:, None] == banned[None, :]).to(tl.int32), axis=1) != 0
            finite = tl.abs(x) < float("inf")  # NaN compares false too
            kept = tl.maximum(kept, (finite & ~is_banned).to(tl.int32))
        tl.debug_barrier()  # the bias stores above and the scan's loads come before these stores
        if tl.max(kept, axis=0) != 0:
            tl.store(out_row + banned, tl.full((BANS,), float("-inf"), tl.float32), mask=banned < vocab)


def adjust_logits(logits, slot, mask_row, masks, counts, prompt_seen, repetition, frequency, presence,
                  bias_ids, bias_values, banned, ban):
    """A new float32 [rows, vocab] tensor: logits [rows, vocab] (any float dtype, unit stride along
    the vocabulary) with each row's logit_bias added, its token mask applied, its bans applied
    unless they would leave it no finite token, and its penalties from its token counts.

    Per row: slot [rows] int64, its row of counts/prompt_seen [slots, vocab] (int32 / bool) and of
    bias_ids/bias_values [slots, BIAS] (padding entries 0 / 0.0), where slot 0 is all zeros (no
    penalties, no bias); mask_row [rows] int64, its row of masks [mask rows, ceil(vocab / 32)] int32
    (bit t % 32 of word t // 32 allows token t), where row 0 allows every token; repetition,
    frequency, presence [rows] float32; banned [rows, BANS] int64 and ban [rows] bool."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and counts.shape[1] == vocab and prompt_seen.shape[1] == vocab
    assert masks.stride(1) == 1 and masks.shape[1] * 32 >= vocab
    out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out
    block = 2048
    seen = prompt_seen.view(torch.uint8)
    _mask_and_penalize_kernel[(rows, triton.cdiv(vocab, block))](
        logits, out, slot, mask_row, masks, counts, seen, repetition, frequency, presence, vocab, logits.stride(0),
        masks.stride(0), BLOCK=block, num_warps=8, enable_fp_fusion=False)
    _bias_and_bans_kernel[(rows,)](
        logits, out, slot, mask_row, masks, counts, seen, repetition, frequency, presence,
        bias_ids.contiguous(), bias_values.contiguous(), banned.contiguous(), ban.view(torch.uint8), vocab,
        logits.stride(0), masks.stride(0), BIAS=bias_ids.shape[1], BANS=banned.shape[1], BLOCK=1024,
        num_warps=4, enable_fp_fusion=False)
    return out
