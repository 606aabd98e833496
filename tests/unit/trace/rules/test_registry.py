from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import graphmem
from graphmem.trace.rules.registry import ArgMeta, RuleKind, register, rules_for, scratch_bytes

aten = torch.ops.aten


def test_register_rejects_packets() -> None:
    with pytest.raises(TypeError, match="OpOverload"):
        register(aten.mm, device="test-device")


def test_register_rejects_duplicates_naming_both() -> None:
    @register(aten.bmm.default, device="test-dup")
    def first(args: Any, kwargs: Any) -> int:
        return 0

    with pytest.raises(ValueError, match="first.*second"):
        @register(aten.bmm.default, device="test-dup")
        def second(args: Any, kwargs: Any) -> int:
            return 0


def test_one_rule_registers_for_a_list_of_ops() -> None:
    @register([aten.mm.default, aten.bmm.default], device="test-list", kind=RuleKind.SCRATCH)
    def workspace(args: Any, kwargs: Any) -> int:
        return 64

    table = rules_for("test-list")
    assert table.scratch[aten.mm.default] is workspace and table.scratch[aten.bmm.default] is workspace


def test_register_rejects_an_unknown_kind_listing_the_kinds() -> None:
    with pytest.raises(ValueError, match="scratch.*value_kernel"):
        register(aten.mm.default, device="test-kind", kind="workspace")


def test_rules_take_plain_tuples() -> None:
    a = ArgMeta((2, 3), torch.float32, (3, 1))
    rule = lambda args, kwargs: args[0].shape[0] * 8
    assert scratch_bytes(rule, (a,), {}) == 16


def test_rule_answer_is_checked() -> None:
    with pytest.raises(AssertionError, match="non-negative int"):
        scratch_bytes(lambda args, kwargs: -1, (), {})


def test_extra_rules_override_and_reach_the_peak() -> None:
    table = rules_for("cpu", {aten.mm.default: lambda args, kwargs: 1000})
    assert aten.mm.default in table.scratch
    # Linear(4,3) no bias on 2x4: 48 + 32 + 24 = 104 B live at mm, plus 1000 B of scratch
    report = graphmem.analyze(lambda: nn.Linear(4, 3, bias=False), ["2x4"], mode="inference",
                              rules={aten.mm.default: lambda args, kwargs: 1000})
    assert report.inference is not None
    assert report.inference.peak_bytes == 1104
    assert "aten.mm.default" not in report.inference.unmodeled_ops
