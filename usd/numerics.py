"""Telling rounding from a defect when two greedy answers differ.

Greedy identity rests on a (k+1)-token verify forward choosing the same argmax as single steps. The two sum the same
products in different orders, so their logits differ by rounding: nothing in float32 on a CPU, more in bf16 or a
4-bit model on a GPU. Where the target's two best tokens are that close, either answer is the target's; elsewhere a
difference is a defect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .pair import Pair

ROUNDING_UNITS = 16
"""How many units of the model's float format (at the logit's size) a long chain of sums can drift by."""
MIN_RELATIVE_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Divergence:
    position: int
    """The first answer position where the two answers differ."""
    gap: float
    """The target's top logit minus its second, there, from a plain forward over the common prefix."""
    tolerance: float
    """The gap below which rounding in the model's dtype can swap the two tokens."""
    dtype: str

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.tolerance

    def explain(self) -> str:
        if self.near_tie:
            return (
                f"a near-tie: the target's two best tokens there are {self.gap:.4g} logits apart, within "
                f"{self.dtype} rounding ({self.tolerance:.3g}); either token is the target's answer"
            )
        return (
            f"not a near-tie: the target's two best tokens there are {self.gap:.4g} logits apart, beyond "
            f"{self.dtype} rounding ({self.tolerance:.3g}); this is a defect, please report it"
        )


def compute_dtype(model) -> torch.dtype:
    """The dtype the model computes in (a 4-bit model reports its compute dtype here, not uint8)."""
    dtype = getattr(model, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def divergence(pair: Pair, prompt_ids: list[int], answer_ids: list[int], position: int) -> Divergence:
    logits = pair.target_runner.new_context(list(prompt_ids) + list(answer_ids[:position])).forward(keep=1)[-1]
    top = torch.topk(logits.float(), 2).values
    dtype = compute_dtype(pair.target)
    scale = max(1.0, abs(float(top[0])))
    tolerance = max(MIN_RELATIVE_TOLERANCE, ROUNDING_UNITS * torch.finfo(dtype).eps) * scale
    return Divergence(position, float(top[0] - top[1]), tolerance, str(dtype).removeprefix("torch."))
