from __future__ import annotations

import pytest
import torch

from graphmem.errors import UserInputError
from graphmem.job.spec import InputSpec, parse_dtype, parse_input_spec


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
