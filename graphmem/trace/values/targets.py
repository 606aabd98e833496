"""Ground truth a detection model trains on, and the sizes of the boxes it predicts.

Used by stage 2 (trace).  A torchvision detection model (Faster/Mask/Keypoint R-CNN,
RetinaNet, FCOS, SSD) in training mode computes its own losses and needs ``targets``: one
dict per image, ``boxes`` (n x 4, x1 y1 x2 y2 in pixels) and ``labels`` (n, int64), plus
``masks`` (n x H x W, uint8) for Mask R-CNN and ``keypoints`` (n x K x 3) for Keypoint
R-CNN.  Where the job gives none, graphmem makes them: ``n`` boxes per image (default
``graphmem.job.assume.DEFAULT_BOXES``, ``--assume boxes=N``), each half the image's width and height, laid out on
a grid, of class 1, with a mask filling the box and keypoints on its diagonal.  Each is a
fake input whose real value is known (a shadow, graphmem.trace.values.shadows), as the model's checks
on them read values (``degenerate boxes``).  The loss is the sum of the losses the model
returns, as torchvision's reference training script sums them.

In inference, an R-CNN reads the boxes it predicted: Mask R-CNN pastes each box's mask into
the image at the box's size (``int(box[2] - box[0])``), Keypoint R-CNN reads keypoints from
heatmaps resized to each box.  Those sizes depend on values graphmem does not have; each
box is taken as covering the whole image (``predicted_boxes``), the largest a box can be
once the box head clips it to the image, so the memory of every paste is at its most.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import hint_of, unset_fake_temporarily

__all__ = ["detection_targets", "predicted_boxes", "target_kinds", "target_values"]

_DETECTION_CLASSES = (("torchvision.models.detection.generalized_rcnn", "GeneralizedRCNN"),
                      ("torchvision.models.detection.retinanet", "RetinaNet"),
                      ("torchvision.models.detection.fcos", "FCOS"), ("torchvision.models.detection.ssd", "SSD"))


def _takes_targets(model: nn.Module) -> bool:
    """Whether ``model`` is one of torchvision's detection models (they need targets to train)."""
    classes = tuple(getattr(sys.modules[module], name) for module, name in _DETECTION_CLASSES
                    if module in sys.modules and hasattr(sys.modules[module], name))
    return isinstance(model, classes)


def target_values(model: nn.Module, images: torch.Tensor, boxes: int) -> list[dict[str, torch.Tensor]]:
    """Real targets for a batch of images (B x C x H x W): ``boxes`` per image (see above)."""
    batch, (height, width) = images.shape[0], tuple(int(d) for d in images.shape[-2:])
    masks_too, keypoints = target_kinds(model)
    targets = []
    for _ in range(batch):
        corners = [(width * (k % 4) / 8, height * (k // 4 % 4) / 8) for k in range(boxes)]
        box = torch.tensor([[x, y, x + width / 2, y + height / 2] for x, y in corners], dtype=torch.float32)
        target = {"boxes": box, "labels": torch.ones(boxes, dtype=torch.int64)}
        if masks_too:
            masks = torch.zeros(boxes, height, width, dtype=torch.uint8)
            for k, (x, y) in enumerate(corners):
                masks[k, int(y):int(y + height / 2), int(x):int(x + width / 2)] = 1
            target["masks"] = masks
        if keypoints:
            steps = torch.linspace(0, 1, keypoints)
            points = torch.stack([box[:, None, 0] + steps * width / 2, box[:, None, 1] + steps * height / 2,
                                  torch.ones(boxes, keypoints)], dim=-1)
            target["keypoints"] = points
        targets.append(target)
    return targets


def detection_targets(model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any],
                      boxes: int) -> list[dict[str, torch.Tensor]] | None:
    """The real targets for the model's images (its first input), or None where the model
    takes none or the job gave them."""
    if not _takes_targets(model) or "targets" in kwargs or len(args) > 1:
        return None
    images = args[0] if args else kwargs.get("images")
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        return None
    return target_values(model, images, boxes)


def target_kinds(model: nn.Module) -> tuple[bool, int]:
    """(masks, keypoints per box) the model's targets hold besides boxes and labels: masks for
    an R-CNN with a mask head, keypoints (its predictor's count) with a keypoint head."""
    heads = getattr(model, "roi_heads", None)
    if heads is None:
        return False, 0
    keypoints = heads.keypoint_predictor.kps_score_lowres.out_channels if heads.has_keypoint() else 0
    return bool(heads.has_mask()), int(keypoints)


@contextlib.contextmanager
def predicted_boxes(model: nn.Module, known: Callable[[torch.Tensor, torch.Tensor], None]) -> Iterator[None]:
    """While open, the boxes ``model`` (an R-CNN) predicts are given to ``known`` with their
    values taken as the whole image each (x1 y1 x2 y2 = 0 0 width height: see above)."""
    heads = getattr(model, "roi_heads", None)
    if not _takes_targets(model) or heads is None or not hasattr(heads, "postprocess_detections"):
        yield
        return
    original = heads.postprocess_detections

    def postprocess(*args: Any, **kwargs: Any) -> Any:
        boxes, scores, labels = original(*args, **kwargs)
        shapes = args[3] if len(args) > 3 else kwargs["image_shapes"]
        for box, (height, width) in zip(boxes, shapes, strict=True):
            with unset_fake_temporarily():
                whole = torch.tensor([0.0, 0.0, float(width), float(height)], dtype=box.dtype)
                known(box, whole.expand(tuple(hint_of(d) for d in box.shape)).contiguous())
        return boxes, scores, labels

    heads.postprocess_detections = postprocess  # on this instance only, for this recording
    try:
        yield
    finally:
        del heads.postprocess_detections
