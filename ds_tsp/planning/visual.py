"""What a vision-language model's tower adds to a TSP training step's bytes (DESIGN.md 6m).

Per rank and step, beside the text decoder's bytes (``communication.tsp_step_bytes_by_op``):

* ``all_gather``, forward: every tower unit's flat vector, ``D-1`` slices of
  ``ceil(numel / D)`` elements each (``ds_tsp.blocks.tower``);
* ``reduce_scatter``, backward: the same slices of the units' gradients;
* ``all_to_all``: the merged visual rows this rank receives for its
  placeholder tokens from the ranks that encoded them (forward), and the
  gradients of the rows it encoded for other ranks' tokens (backward),
  ``features x H`` elements a row (Qwen3-VL's deepstack features ride
  beside the merged rows: ``features`` = 1 + their count).

Where the rows go depends on where the batch's placeholders sit: the
``rows_exchanged`` pair (received forward, received backward) is exact for a
given batch, by default the expected ``(D-1)/D`` of the ``visual_rows / D``
rows a rank holds, for placeholders spread evenly over the ranks.
"""

import math
from fractions import Fraction


def tsp_visual_bytes_by_op(unit_numels, hidden_size, visual_rows, tsp_size, elem_bytes, *, features=1,
                           rows_exchanged=None, trained_numels=None):
    """Bytes one rank receives for the vision tower in one training step, per
    ``comm`` op name: ``unit_numels`` the tower's units' parameter counts,
    ``visual_rows`` the micro-batch's placeholder tokens (none: no tower runs).
    ``trained_numels``: the units backward reaches (by default all; LLaVA's
    last tower layer and post-norm feed nothing the model reads, so no
    gradient reaches them and none is reduce-scattered)."""
    D, e = tsp_size, elem_bytes
    if D == 1 or not visual_rows:
        return {}
    if rows_exchanged is None:
        expected = Fraction((D - 1) * visual_rows, D * D)
        rows_exchanged = (expected, expected)
    trained_numels = unit_numels if trained_numels is None else trained_numels
    row = features * hidden_size * e
    return {"all_gather": (D - 1) * sum(math.ceil(numel / D) for numel in unit_numels) * e,
            "reduce_scatter": (D - 1) * sum(math.ceil(numel / D) for numel in trained_numels) * e,
            "all_to_all": (rows_exchanged[0] + rows_exchanged[1]) * row}
