"""Fused Hugging Face projections: one tensor holding the rows of several logical ones.

Phi-3 keeps q, k and v in one ``qkv_proj`` (rows: q, then k, then v) and gate
and up in one ``gate_up_proj`` (gate, then up). The TSP blocks shard logical
projections (a rank's query heads, its key/value heads, its columns of ``F``),
so each of their tensors is a row range of the fused one: ``k_proj.weight`` is
rows ``[nq*d, nq*d + nkv*d)`` of ``qkv_proj.weight``, and a rank's piece of it
the same piece shifted by ``nq*d``. A policy names the fused tensors and the
projections they hold, in row order (``DecoderPolicy.fused``); the offsets
follow from the projections' sizes. Biases follow their weights' rows.

``FusedRows`` is the one translation between the two sets of names, used
wherever the TSP blocks meet Hugging Face's tensors: reading a rank's pieces
(``reader``), planning which pieces of which file tensor a rank holds
(``hf_holdings``) and writing full tensors back (``fuse``), so every reader and
writer sees the names and bytes Hugging Face's own ``save_pretrained`` writes.
"""

from dataclasses import dataclass, field

import torch

KINDS = ("weight", "bias")


@dataclass(frozen=True)
class FusedRows:
    """``sources[name] = (hf_name, first_row)`` for each logical tensor of a
    TSP block (``k_proj.weight``) that lies in a fused Hugging Face tensor;
    every other name is Hugging Face's own (no entry: Llama-shaped blocks)."""

    sources: dict = field(default_factory=dict)
    totals: dict = field(default_factory=dict)  # fused projection -> its rows, all its parts'

    @classmethod
    def of(cls, table, rows):
        """From a policy's ``table`` for one block (``{fused projection:
        (logical projections in row order)}``) and ``rows``, each logical
        projection's full number of rows."""
        sources, totals = {}, {}
        for fused, parts in table.items():
            first = 0
            for part in parts:
                sources.update({f"{part}.{kind}": (f"{fused}.{kind}", first) for kind in KINDS})
                first += rows[part]
            totals[fused] = first
        return cls(sources, totals)

    def hf_module(self, block, projection):
        """The Linear of the Hugging Face ``block`` that holds ``projection``'s rows."""
        return block.get_submodule(self.hf_name(f"{projection}.weight").removesuffix(".weight"))

    def check_rows(self, block, where):
        """Refuse a fused Linear with more or fewer rows than its parts: rows no
        part accounts for would be dropped."""
        for fused, total in self.totals.items():
            rows = block.get_submodule(fused).out_features
            if rows != total:
                raise ValueError(f"{where}.{fused} has {rows} rows, but its parts {self.parts(fused)} have {total}: "
                                 "not the fused layout ds_tsp knows")

    def parts(self, fused):
        return [name.removesuffix(".weight") for name, (hf_name, _) in self.sources.items()
                if hf_name == f"{fused}.weight"]

    def hf_name(self, name):
        """The Hugging Face tensor that holds the logical tensor ``name``."""
        return self.sources.get(name, (name, 0))[0]

    def hf_piece(self, name, piece):
        """``(hf_name, piece)``: where the piece ``(dim, start, length)`` of the
        logical tensor ``name`` lies in Hugging Face's tensor."""
        if name not in self.sources:
            return name, piece
        hf_name, first = self.sources[name]
        if self.renames(hf_name):
            return hf_name, piece
        if piece is None or piece[0] != 0:
            # Every fused projection is split by rows (heads, columns of F), so this never happens.
            raise ValueError(f"{name} lies in rows of {hf_name}: only a piece of its rows can be read, not {piece}")
        return hf_name, (0, first + piece[1], piece[2])

    def reader(self, read):
        """``read(name, piece)`` under the logical names over ``read`` under Hugging Face's."""
        if not self.sources:
            return read
        return lambda name, piece: read(*self.hf_piece(name, piece))

    def hf_holdings(self, held):
        """A rank's ``{logical name: piece}`` as ``{hf_name: piece}``; a fused
        tensor of which it holds several pieces gets them all, as a tuple in row order."""
        out = {}
        for name, piece in held.items():
            hf_name, hf_piece = self.hf_piece(name, piece)
            if name in self.sources and not self.renames(hf_name):
                out[hf_name] = tuple(sorted((*out.get(hf_name, ()), hf_piece), key=lambda p: p[1]))
            else:
                out[hf_name] = hf_piece
        return out

    def renames(self, hf_name):
        """Whether the Hugging Face tensor ``hf_name`` holds one logical tensor only (a projection under another
        name, Granite-4.0-H's ``output_linear``), any piece of which is read as it is."""
        return len(self.parts(hf_name.rsplit(".", 1)[0])) == 1

    def fuse(self, full):
        """``{hf_name: tensor}`` from the logical tensors ``full`` (each whole):
        the parts of a fused tensor concatenated in row order."""
        out, parts = {}, {}
        for name, tensor in full.items():
            if name in self.sources:
                hf_name, first = self.sources[name]
                parts.setdefault(hf_name, []).append((first, name, tensor))
                out.setdefault(hf_name, None)  # keeps the first part's place in the order
            else:
                out[name] = tensor
        for hf_name, pieces in parts.items():
            pieces.sort(key=lambda part: part[0])
            end = 0
            for first, name, tensor in pieces:
                if first != end:
                    raise RuntimeError(f"{name} starts at row {first} of {hf_name}, but its parts end at row {end}")
                end += tensor.shape[0]
            out[hf_name] = torch.cat([tensor for _, _, tensor in pieces])
        return out


def split_rows(held, tensor):
    """``[(piece, tensor part)]`` of a tensor that holds the rows of a holding
    (``hf_holdings``): several pieces concatenated in order, or one."""
    if not _several(held):
        return [(held, tensor)]
    return list(zip(held, tensor.split([length for _, _, length in held])))


def row_pieces(held):
    """The pieces one holding ``hf_holdings`` gives is: its tuple of pieces, or the one piece (None: whole)."""
    return list(held) if _several(held) else [held]


def _several(held):
    return held is not None and isinstance(held[0], (tuple, list))
