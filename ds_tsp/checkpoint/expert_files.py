"""transformers' per-expert file layout of sparse-MoE blocks, against the fused tensors the model holds.

transformers 5 holds a sparse-MoE block's experts fused, ``mlp.experts.gate_up_proj``
``(E, 2F, H)`` and ``mlp.experts.down_proj`` ``(E, H, F)``, but Hub checkpoints
hold one tensor per expert and projection, and transformers' own
``save_pretrained`` writes that layout back (its ``conversion_mapping.py``,
reverted on save)::

    Mixtral               block_sparse_moe.experts.{e}.w1 / w3 / w2 .weight     (gate, up, down)
    Qwen2/3-MoE, GLM-4.5, mlp.experts.{e}.gate_proj / up_proj / down_proj .weight
    OLMoE and the rest

where ``gate_up_proj[e]`` is gate then up on dim 0 (``(F, H)`` each) and
``down_proj[e]`` is down; Mixtral's whole block is renamed in the files
(``block_sparse_moe.`` for ``mlp.``, its router too), ERNIE 4.5-MoE's
score-correction bias lies beside its router (``mlp.moe_statics.`` for
``mlp.gate.moe_statics.``), Nemotron-H's ungated experts are ``up_proj`` and
``down_proj`` alone and its files name the decoder ``backbone.`` for
``model.``. The layout of a model
type is read from transformers' own conversion mapping
(``get_checkpoint_conversion_mapping``). Names and views only, no files:
``reading`` groups file names into the model's tensors, ``writing`` splits the
model's tensors into file names.
"""

import re
from dataclasses import dataclass

from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import dot_natural_key

_FUSED = re.compile(r"(?P<block>.+\.)experts\.(?P<fused>gate_up_proj|up_proj|down_proj)")
_PER_EXPERT = re.compile(r"(?P<block>.+\.)experts\.(?P<expert>\d+)\.(?P<projection>\w+)\.weight")


@dataclass(frozen=True)
class ExpertFiles:
    """How one architecture's files name its tensors where the model names
    them otherwise: ``renames``, ``(file's text, model's text)`` pairs
    (Mixtral's ``.block_sparse_moe.`` where the model has ``.mlp.``, Flint's
    ``softmax_offset`` for ``sinks``), and per fused expert tensor the
    per-expert projections it concatenates (on dim 0 of each expert, in this
    order; none for a dense model)."""

    renames: tuple
    projections: dict
    # ``(model's text, (files' texts))``: a model tensor its files hold in parts, concatenated on dim 0 (OLMo-Hybrid's
    # and Kimi Linear's conv1d: q_conv1d, k_conv1d, v_conv1d), which transformers' save writes as equal chunks.
    concatenations: tuple = ()

    def concatenation_of(self, file_name):
        """``(model name, part index)`` when ``file_name`` is a part of a concatenated model tensor, else None."""
        for model_text, file_texts in self.concatenations:
            for index, file_text in enumerate(file_texts):
                if file_name.endswith(file_text):
                    return self.model_name(file_name[:-len(file_text)]) + model_text, index
        return None

    def file_name(self, name):
        """The file's name of the model's tensor ``name`` (not an expert tensor)."""
        for file_text, model_text in reversed(self.renames):
            name = name.replace(model_text, file_text)
        return name

    def model_name(self, file_name):
        """The model's name of the file's tensor ``file_name`` (not a per-expert one)."""
        for file_text, model_text in self.renames:
            file_name = file_name.replace(file_text, model_text)
        return file_name

    def expert_of(self, file_name):
        """``(fused model name, expert, projection)`` when ``file_name`` is one
        expert's projection in this layout, else None."""
        match = _PER_EXPERT.fullmatch(file_name)
        if match is None:
            return None
        fused = next((f for f, projections in self.projections.items() if match["projection"] in projections), None)
        if fused is None:
            return None
        return f"{self.model_name(match['block'])}experts.{fused}", int(match["expert"]), match["projection"]

    def projections_of(self, name):
        """The per-expert projections of the fused model tensor ``name``, in its order."""
        return self.projections[_FUSED.fullmatch(name)["fused"]]

    def expert_file_name(self, name, expert, projection):
        """The file's name of ``projection`` of ``expert`` of the fused model tensor ``name``."""
        return f"{self.file_name(_FUSED.fullmatch(name)['block'])}experts.{expert}.{projection}.weight"

    def files_of(self, name, tensor):
        """``[(file name, tensor)]`` that the model's tensor ``name`` is written as
        (views of ``tensor``), in transformers' order: each projection's experts in turn."""
        for model_text, file_texts in self.concatenations:
            if name.endswith(model_text):
                prefix = self.file_name(name[:-len(model_text)])
                parts = tensor.chunk(len(file_texts))
                return [(prefix + file_text, part) for file_text, part in zip(file_texts, parts)]
        if not self.projections or _FUSED.fullmatch(name) is None:
            return [(self.file_name(name), tensor)]
        projections = self.projections_of(name)
        return [(self.expert_file_name(name, expert, projection), part[expert])
                for projection, part in zip(projections, tensor.chunk(len(projections), dim=1))
                for expert in range(tensor.shape[0])]


_SOURCE_PROJECTION = re.compile(r"experts\.\*\.(?P<projection>\w+)\.weight$")
_TARGET_FUSED = re.compile(r"experts\.(?P<fused>gate_up_proj|up_proj|down_proj)$")
_PLAIN_NAME = re.compile(r"[\w.]+")  # a renaming's pattern that names tensors literally (no wildcards)


def _literal(pattern):
    """A renaming's regular expression as the text it matches, where it names
    tensors literally (``\\.`` for a dot), else None."""
    text = pattern.replace("\\.", ".")
    return text if _PLAIN_NAME.fullmatch(text) else None


def expert_files(config):
    """The ``ExpertFiles`` of a model's config, from transformers' conversion
    mapping for its ``model_type``: its sparse-MoE blocks' per-expert layout and
    the tensors its files name otherwise (Flint's ``softmax_offset`` for the
    model's ``sinks``), or None where its files name every tensor as the model
    does. A renaming by a pattern (not a literal name) ds_tsp does not follow:
    a tensor it renames is then missing from the checkpoint, by name."""
    renames, projections, concatenations = [], {}, []
    for conversion in get_checkpoint_conversion_mapping(getattr(config, "model_type", None)) or []:
        sources, targets = list(conversion.source_patterns), list(conversion.target_patterns)
        fused = _TARGET_FUSED.search(targets[0]) if len(targets) == 1 else None
        parts = [_SOURCE_PROJECTION.search(source) for source in sources]
        literal = [_literal(pattern) for pattern in sources + targets]
        if fused and all(parts):
            projections[fused["fused"]] = tuple(part["projection"] for part in parts)
        elif len(sources) == len(targets) == 1 and None not in literal:
            renames.append((literal[0], literal[1]))
        elif len(targets) == 1 < len(sources) and None not in literal and _concatenates(conversion):
            concatenations.append((literal[-1], tuple(literal[:-1])))
    if projections and set(projections) not in ({"gate_up_proj", "down_proj"}, {"up_proj", "down_proj"}):
        return None
    return ExpertFiles(tuple(renames), projections, tuple(concatenations)) \
        if renames or projections or concatenations else None


def _concatenates(conversion):
    """Whether a converter only concatenates its sources on dim 0 (transformers' ``Concatenate(dim=0)``)."""
    operations = getattr(conversion, "operations", ())
    return len(operations) == 1 and type(operations[0]).__name__ == "Concatenate" and operations[0].dim == 0


def to_files(layout, tensors):
    """``{file name: tensor}`` of the model's ``{name: tensor}`` as transformers
    writes them: per expert under ``layout``, in its save order (the model's
    names in natural order, each expanded), else unchanged."""
    if layout is None:
        return dict(tensors)
    # transformers' save order (its revert_weight_conversion sorts the names so).
    return {file_name: part for name in sorted(tensors, key=dot_natural_key)
            for file_name, part in layout.files_of(name, tensors[name])}
