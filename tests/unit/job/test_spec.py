from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from graphmem.errors import UserInputError
from graphmem.job.generation import parse_generate
from graphmem.job.spec import InputSpec, parse_assumption, parse_dtype, parse_input_spec, parse_sweep


@pytest.mark.parametrize("text, expected", [
    ("32x1000", InputSpec((32, 1000), torch.float32)),
    ("8x512:int64", InputSpec((8, 512), torch.int64)),
    ("input_ids=2x128:int64", InputSpec((2, 128), torch.int64, "input_ids")),
    ("4:bf16", InputSpec((4,), torch.bfloat16)),
    ("x=1x2x3:half", InputSpec((1, 2, 3), torch.float16, "x")),
    ("scalar", InputSpec((), torch.float32)),
    (" 2X3 ", InputSpec((2, 3), torch.float32)),
])
def test_parse_input_spec(text: str, expected: InputSpec) -> None:
    assert parse_input_spec(text) == expected


@pytest.mark.parametrize("text, fragment", [
    ("32xa", "dimension 'a'"),
    ("32x-3", "dimension '-3'"),
    ("32x0", "<= 0"),
    ("32x1000:foo", "unknown dtype 'foo'"),
    ("1=2x3", "malformed"),
    ("32x", "dimension ''"),
])
def test_parse_input_spec_rejects(text: str, fragment: str) -> None:
    with pytest.raises(UserInputError) as info:
        parse_input_spec(text)
    assert fragment in str(info.value)


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("BF16", torch.bfloat16),
                                         ("long", torch.int64), ("int", torch.int32),
                                         ("torch.float16", torch.float16), ("bool", torch.bool)])
def test_parse_dtype_aliases(name: str, dtype: torch.dtype) -> None:
    assert parse_dtype(name) is dtype


def test_unknown_dtype_lists_choices() -> None:
    with pytest.raises(UserInputError, match="expected one of: .*bfloat16"):
        parse_dtype("float8")


def test_spec_str_round_trips() -> None:
    spec = InputSpec((2, 128), torch.int64, "input_ids")
    assert parse_input_spec(str(spec)) == spec


def test_parse_sweep() -> None:
    from graphmem.job.spec import parse_sweep

    assert parse_sweep("B=1..4") == ("B", (1, 2, 3, 4))
    assert parse_sweep("S=512,128,512") == ("S", (128, 512))
    letter, values = parse_sweep("B=1..1024")
    assert letter == "B" and len(values) <= 32 and values[0] == 1 and values[-1] == 1024
    assert list(values) == sorted(set(values))
    for text in ("b=1..4", "B=", "B=1..x", "X=1..4", "B=0..3", "B=-1,2"):
        with pytest.raises(UserInputError):
            parse_sweep(text)


# --- sizes past int64, digits int() cannot read ----------------------------------------------

@pytest.mark.parametrize("text", ["99999999999999999999x4", "2305843009213693952x4", "4611686018427387904:int16"])
def test_an_input_past_int64_bytes_is_a_user_error(text: str) -> None:
    # 2305843009213693952 x 4 elements x 4 bytes = 2**65; 2**62 int16 elements = 2**63 bytes, one past the most
    with pytest.raises(UserInputError, match="too large.*a tensor can hold"):
        parse_input_spec(text)


def test_the_largest_input_a_tensor_can_hold_is_taken() -> None:
    assert parse_input_spec("4611686018427387903:int16").shape == (2**62 - 1,)  # 2**63 - 2 bytes


def test_a_digit_int_cannot_read_is_malformed() -> None:
    with pytest.raises(UserInputError, match="dimension '²'"):  # "²".isdigit() is True, int("²") raises
        parse_input_spec("²x4")
    with pytest.raises(UserInputError, match="malformed --assume"):
        parse_assumption("reads=²")


@pytest.mark.parametrize("parse, text", [
    (parse_generate, "99999999999999999999+1"),
    (parse_sweep, "B=1..99999999999999999999"),
    (parse_assumption, "attention_mask=99999999999999999999"),
    (parse_assumption, "reads=99999999999999999999"),
])
def test_numbers_past_int64_are_user_errors(parse: Callable[[str], object], text: str) -> None:
    with pytest.raises(UserInputError):
        parse(text)
