"""The error word's vocabulary and the frontend's reading of it (no kernel involved)."""

import pytest
import torch

import tqkern_torch as tqt
from tqkern.errors import ErrorFlag, describe
from tqkern_torch.errors import error_word


def test_describe_names_each_bit():
    assert describe(0) == ""
    lines = describe(int(ErrorFlag.SLOT_OUT_OF_RANGE | ErrorFlag.BLOCK_OUT_OF_RANGE)).splitlines()
    assert [line.split(":")[0] for line in lines] == ["SLOT_OUT_OF_RANGE", "BLOCK_OUT_OF_RANGE"]
    assert describe(64 | int(ErrorFlag.SATURATED)).splitlines()[-1] == "unknown bits 0x40"


def test_describe_rejects_non_ints():
    with pytest.raises(TypeError, match="bits must be an int, got str"):
        describe("1")
    with pytest.raises(TypeError, match="bits must be an int, got bool"):
        describe(True)


def test_check_errors_raises_then_clears():
    dev = torch.device("cpu")
    tqt.read_errors(dev)
    error_word(dev).bitwise_or_(int(ErrorFlag.NONFINITE_INPUT | ErrorFlag.SATURATED))
    with pytest.raises(tqt.TQKernError, match="NONFINITE_INPUT") as err:
        tqt.check_errors(dev)
    assert err.value.flags == ErrorFlag.NONFINITE_INPUT | ErrorFlag.SATURATED
    assert err.value.device == dev
    assert isinstance(err.value, RuntimeError)
    tqt.check_errors(dev)  # cleared


def test_read_errors_without_clearing():
    dev = torch.device("cpu")
    tqt.read_errors(dev)
    error_word(dev).bitwise_or_(int(ErrorFlag.SEQ_LEN_OUT_OF_RANGE))
    assert tqt.read_errors(dev, clear=False) == ErrorFlag.SEQ_LEN_OUT_OF_RANGE
    assert tqt.read_errors(dev) == ErrorFlag.SEQ_LEN_OUT_OF_RANGE
    assert tqt.read_errors(dev) == ErrorFlag(0)


def test_the_word_is_one_per_device():
    assert error_word("cpu") is error_word(torch.device("cpu"))
    assert error_word("cpu").dtype == torch.int32 and error_word("cpu").shape == (1,)
