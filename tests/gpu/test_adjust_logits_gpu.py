"""kernels/adjust_logits.py on a GPU at the decode graphs' shapes (64 rows, SmolLM2's and Qwen3's
vocabularies, bf16 and float32 logits), against its torch operations, eagerly and captured in a
CUDA graph as the adjusted sampling graphs hold it. Fresh random inputs each run; the output is
NaN-poisoned before the kernels write it.
"""
import importlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from engine.runner.decode_graphs import adjust_logits_torch  # noqa: E402
from tests.kernel_checks import adjust_logits_inputs, assert_close, capture, poison  # noqa: E402,F401 (fixtures)

adjust = importlib.import_module("kernels.adjust_logits")


def _check(out, expected):
    assert_close(out, expected, torch.float32)
    assert torch.equal(out.isinf(), expected.isinf())
    assert torch.equal(out.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("vocab", [49152, 151936])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adjusted_logits_match_the_torch_operations(vocab, dtype, poison):
    args = adjust_logits_inputs(dtype, "cuda", rows=64, vocab=vocab, slots=17, mask_rows=17)
    expected = adjust_logits_torch(*args)
    with poison():
        out = adjust.adjust_logits(*args)
    _check(out, expected)
    assert torch.isfinite(out[3].gather(0, args[11][3])).all(), "row 3's bans would leave it nothing"


def test_a_captured_graph_adjusts_each_replay_from_its_inputs():
    args = adjust_logits_inputs(torch.bfloat16, "cuda", rows=64, vocab=49152, slots=17, mask_rows=17)
    graph, out = capture(lambda: adjust.adjust_logits(*args))
    counts = args[4]
    for _ in range(2):  # new logits and counts in place, as the engine's buffers change between steps
        args[0].copy_(torch.randn_like(args[0], dtype=torch.float32).mul_(4))
        # Slot 0 stays all zeros: it is the rows without penalties, whose counts nothing writes.
        counts[1:].add_((torch.rand_like(counts[1:], dtype=torch.float32) < 0.01).int())
        graph.replay()
        _check(out, adjust_logits_torch(*args))
