"""graphmem.trace.values.targets: the ground truth made for a detection model, by hand from the
rule in its docstring (``n`` boxes per image, each half the image's width and height, on a
grid of eighths, class 1, a mask filling the box, keypoints on its diagonal).  No model runs;
the model stand-ins only answer what the heads are asked."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from graphmem.trace.values.targets import detection_targets, target_kinds, target_values


def _rcnn(mask: bool, keypoints: int) -> nn.Module:
    """A stand-in for an R-CNN: its ``roi_heads`` say which heads it has."""
    model = nn.Module()
    predictor = SimpleNamespace(kps_score_lowres=SimpleNamespace(out_channels=keypoints))
    heads = SimpleNamespace(has_mask=lambda: mask, has_keypoint=lambda: keypoints > 0, keypoint_predictor=predictor)
    model.roi_heads = heads  # type: ignore[assignment]  # a plain attribute, not a submodule
    return model


def test_boxes_lie_on_a_grid_of_eighths() -> None:
    images = torch.empty(2, 3, 64, 96)  # 2 images, 64 high, 96 wide
    targets = target_values(nn.Linear(1, 1), images, 5)
    assert len(targets) == 2 and set(targets[0]) == {"boxes", "labels"}  # no mask or keypoint head
    # box k at x = 96 * (k % 4) / 8, y = 64 * (k // 4) / 8, 48 wide (96 / 2) and 32 high (64 / 2)
    assert targets[0]["boxes"].tolist() == [[0, 0, 48, 32], [12, 0, 60, 32], [24, 0, 72, 32], [36, 0, 84, 32],
                                            [0, 8, 48, 40]]
    assert targets[0]["labels"].tolist() == [1, 1, 1, 1, 1] and targets[0]["labels"].dtype == torch.int64
    assert torch.equal(targets[0]["boxes"], targets[1]["boxes"])  # every image alike


def test_a_mask_fills_its_box_and_keypoints_run_down_its_diagonal() -> None:
    images = torch.empty(1, 3, 16, 32)
    [target] = target_values(_rcnn(mask=True, keypoints=3), images, 2)
    masks = target["masks"]
    assert masks.shape == (2, 16, 32) and masks.dtype == torch.uint8
    # box 0 covers rows 0-7 and columns 0-15 (16 / 2, 32 / 2); box 1 starts 4 columns right (32 / 8)
    assert [int(m.sum()) for m in masks] == [8 * 16, 8 * 16]
    assert masks[1, :8, 4:20].all() and not masks[1, :, :4].any() and not masks[1, 8:].any()
    # 3 keypoints from the box's corner to half the image on: x = x1 + (0, 1/2, 1) * 16, y = (0, 1/2, 1) * 8
    assert target["keypoints"][1].tolist() == [[4, 0, 1], [12, 4, 1], [20, 8, 1]]


def test_the_heads_decide_what_the_targets_hold() -> None:
    assert target_kinds(nn.Linear(1, 1)) == (False, 0)  # no roi_heads: boxes and labels only
    assert target_kinds(_rcnn(mask=True, keypoints=0)) == (True, 0)
    assert target_kinds(_rcnn(mask=False, keypoints=17)) == (False, 17)  # the predictor's channels


def test_a_model_that_is_not_a_detection_model_gets_no_targets() -> None:
    assert detection_targets(_rcnn(mask=True, keypoints=0), (torch.empty(1, 3, 8, 8),), {}, 4) is None
