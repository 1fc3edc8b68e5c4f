"""Bounds for float32 results, measured against a control run on the same
machine instead of read off one machine's printout.

A float32 result differs from its float64 truth by rounding, and how far
depends on the order in which its sums are taken: the CPU's vector width
(``ATEN_CPU_CAPABILITY``), the BLAS path and the thread count all move it. A
fixed bound set near what one machine printed fails on the next (a gradient
norm bounded at 1e-6 measured 1.17e-6 on another CPU). So a float32 check
runs two float32 computations of the same numbers against the float64 truth:

* the control: the unsharded Hugging Face model, one process, float32; its
  distance to the truth is what this machine's rounding does to this
  computation (the model, its sizes, the steps that amplify rounding, such as
  Adam's division by a small second moment);
* the run under test: the same sums split across ranks and added in other
  orders (per-rank partial sums, the all-reduce's order). Its rounding is of
  the same kind and size, so its distance to the truth is the control's
  times a factor of order one.

``CONTROL_FACTOR`` bounds that ratio. Two float32 evaluations of a sum of
``n`` terms in different orders each err by about ``u sqrt(n)`` in the mean
(``u`` the unit roundoff), with spreads that overlap. The checks compare the
largest error over a model's tensors and steps, and where Adam divides by the
square root of a small second moment those largest errors come from a few
elements each, so they scatter more than the mean: 5.1x seen between two runs
equally right (Qwen2-MoE's experts under Adam, TSP 2 x DP 2, two threads a
rank). A factor of 8 covers that scatter; a wrong shard, position or scale
is off by 1e3 times the bound and more (each test's guard). ``ROUNDING_FLOOR``
covers a control that lands on the truth by chance (one sum, a few
values): 64 ulps, far below what any wrong shard, position or scale moves
(1e-2 and up, shown by each test's guard).
"""

import torch

UNIT_ROUNDOFF = torch.finfo(torch.float32).eps / 2  # 2**-24
CONTROL_FACTOR = 8.0
ROUNDING_FLOOR = 64 * UNIT_ROUNDOFF


def float32_bound(control_errors):
    """The bound on a float32 run's distance to the float64 truth, given the
    control's distances to it (relative, any number of tensors or steps)."""
    return CONTROL_FACTOR * max(control_errors) + ROUNDING_FLOOR


def relative_errors(values, truths):
    """``|value - truth| / |truth|`` of matching scalars (None values skipped)."""
    return [abs(value - truth) / abs(truth) for value, truth in zip(values, truths) if value is not None]
