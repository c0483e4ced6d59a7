"""The tolerance table: complete, ordered from the tightest row to the widest, and applied in the dtype computed in."""

import pytest
import torch

from tests.tolerances import TOLERANCES, assert_close, tolerance

ORDER = ["exact", "elementwise", "reduction", "layer", "layer_grad", "model", "training"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_op_has_a_row_and_rows_widen_in_order(dtype):
    assert {op for op, _ in TOLERANCES} == {*ORDER, "attention_kernel"}
    rows = [tolerance(op, dtype) for op in ORDER]
    for (atol, rtol), (wider_atol, wider_rtol) in zip(rows[:-1], rows[1:], strict=True):
        assert atol <= wider_atol and rtol <= wider_rtol, rows


def test_low_precision_rows_are_wider_than_float32():
    for op in ORDER[1:]:
        (atol, rtol), (bf16_atol, bf16_rtol) = tolerance(op, torch.float32), tolerance(op, torch.bfloat16)
        assert bf16_atol > atol and bf16_rtol > rtol


def test_a_bf16_value_is_judged_at_the_bf16_row_against_an_fp32_reference():
    ref = torch.linspace(-2, 2, 101)
    assert_close(ref.bfloat16(), ref, "elementwise")  # one rounding to bf16 is within its row
    with pytest.raises(AssertionError):
        assert_close(ref.bfloat16().float(), ref, "elementwise")  # the same values stated in fp32 are not
    assert_close(ref.bfloat16().float(), ref, "elementwise", dtype=torch.bfloat16)


def test_unknown_ops_are_refused_by_name():
    with pytest.raises(KeyError, match="no tolerance for 'close_enough'"):
        tolerance("close_enough")
