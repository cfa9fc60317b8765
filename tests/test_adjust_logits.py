"""kernels/adjust_logits.py against its torch operations (decode_graphs.adjust_logits_torch, which
test_graph_sampling holds to the eager Sampler), on CPU through Triton's interpreter, with fresh
random inputs each run and the output poisoned (NaN) before the kernels write it.

The rows mix every case the decode graphs stage: neutral rows (slot 0, mask row 0), rows with
penalties and counts, logit_bias (a token named twice too), token masks, bans that apply and bans
that would leave a row no token (then not applied), on logits that are a column slice of a wider
tensor, in float32 and bfloat16.
"""
import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

from engine.runner.decode_graphs import adjust_logits_torch  # noqa: E402
from tests.kernel_checks import adjust_logits_inputs, assert_close, poison  # noqa: E402,F401 (fixtures)

adjust = importlib.import_module("kernels.adjust_logits")
if type(adjust._mask_and_penalize_kernel).__name__ != "InterpretedFunction":
    if torch.cuda.is_available() or os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("the GPU runs tests/gpu/test_adjust_logits_gpu.py", allow_module_level=True)
    adjust = importlib.reload(adjust)  # imported before TRITON_INTERPRET was set: decorate it again
DEVICE = "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adjusted_logits_match_the_torch_operations(dtype, poison):
    args = adjust_logits_inputs(dtype, DEVICE)
    expected = adjust_logits_torch(*args)
    with poison():
        out = adjust.adjust_logits(*args)
    assert_close(out, expected, torch.float32)
    assert torch.equal(out.isinf(), expected.isinf())
    assert torch.equal(out.argmax(-1), expected.argmax(-1))
    # The cases the inputs were built for did occur.
    banned = args[11]
    assert torch.isfinite(out[3].gather(0, banned[3])).all(), "row 3's bans would leave it nothing: not applied"
    assert out[1].gather(0, banned[1]).isneginf().all()


def test_neutral_rows_come_out_as_they_went_in(poison):
    args = list(adjust_logits_inputs(torch.float32, DEVICE))
    rows = args[0].shape[0]
    args[1] = torch.zeros(rows, dtype=torch.int64, device=DEVICE)  # slot 0
    args[2] = torch.zeros(rows, dtype=torch.int64, device=DEVICE)  # mask row 0
    args[12] = torch.zeros(rows, dtype=torch.bool, device=DEVICE)  # no bans
    with poison():
        out = adjust.adjust_logits(*args)
    assert torch.equal(out, args[0])
