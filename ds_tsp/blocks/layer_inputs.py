"""Per-layer inputs (Gemma 4's ``hidden_size_per_layer_input``).

A second embedding holds, in each vocabulary row, every layer's input side by
side (``num_hidden_layers * hidden_size_per_layer_input`` wide). TSP folds it
by vocabulary as the main embedding (``ds_tsp.blocks.vocab``): each rank owns
``1/D`` of its rows, and the rows of a rank's tokens come by the embedding's
all-to-all. The decoder's own ``project_per_layer_inputs`` then mixes them
with a projection of the embedded tokens, token by token, so the local tokens'
inputs are Hugging Face's exactly; each layer gates, projects and adds its own
(``TSPDecoderLayer.add_input``).
"""

from ds_tsp.blocks.vocab import embed_local_tokens, replicated_embedding


def local_layer_inputs(decoder, table, rank_ids, tsp_rank, local_ids, embedded):
    """Every layer's input for this rank's tokens ``(B, S/D, L, P)``: the rows
    of ``table`` (the per-layer embedding, folded or whole) for every rank's
    local ids ``rank_ids`` (``embed_local_tokens``), mixed by ``decoder``'s
    ``project_per_layer_inputs`` with ``embedded``, the main embedding's output."""
    rows = embed_local_tokens(table, rank_ids, tsp_rank, local_ids)
    return decoder.project_per_layer_inputs(embedded, _per_layer(decoder, rows))


def replicated_layer_inputs(decoder, table, ids, embedded):
    """Every layer's input for tokens ``ids`` that every rank holds (generation's new ones)."""
    return decoder.project_per_layer_inputs(embedded, _per_layer(decoder, replicated_embedding(table, ids)))


def _per_layer(decoder, rows):
    """Rows ``(..., L * P)`` as each layer's part ``(..., L, P)``."""
    return rows.view(*rows.shape[:-1], decoder.config.num_hidden_layers, -1)
