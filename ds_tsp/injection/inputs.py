"""What a training micro-batch must be before it reaches a collective.

A TSP forward shards the micro-batch and starts exchanging it at once, so an
input Hugging Face would refuse deep in its forward (an id past the
vocabulary, labels of another shape) would either train silently wrong here
(a missing target's logit taken as 0, labels broadcast over the rows) or fail
inside a collective. Every input is checked first, with the error type
Hugging Face's forward raises for it and a message that names the input:

* ``check_shapes``: dtypes and shapes, from the tensors' metadata (no read);
* ``check_token_ids``: ids and labels in ``[0, V)`` (labels may be -100), on
  the host copy of the batch the forward makes anyway;
* ``left_padding``: rows padded on the left (as generation pads prompts,
  and TRL's GRPO scores prompt + completion rows), which the forward moves to
  the right (``rows_left_aligned``) keeping every token's position.
"""

import torch

from ds_tsp.blocks.vocab import IGNORE_INDEX


class TokenDtypeError(TypeError, RuntimeError):
    """Token ids or labels that are not integers (Hugging Face: the embedding's RuntimeError)."""


class InputShapeError(ValueError, RuntimeError):
    """An input whose shape does not match ``input_ids`` (Hugging Face: the loss's
    ValueError for labels, torch's RuntimeError for positions of another length)."""


class TokenIdError(IndexError, ValueError):
    """An id outside the vocabulary (Hugging Face: IndexError from the embedding or the loss)."""


def check_shapes(input_ids, labels=None, attention_mask=None, position_ids=None):
    """Refuse inputs whose dtype or shape does not match ``input_ids`` ``(B, S)``
    (``position_ids`` may be ``(1, S)``, shared by the rows, as in Hugging Face)."""
    for name, tensor in (("input_ids", input_ids), ("labels", labels)):
        if tensor is not None and (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool):
            raise TokenDtypeError(f"Expected {name} to have one of the following scalar types: Long, Int; but got "
                                  f"{tensor.dtype} instead: pass token ids as integers (torch.long)")
    if input_ids.dim() != 2:
        raise InputShapeError(f"input_ids has shape {tuple(input_ids.shape)}; a TSP forward takes "
                              "(batch, seq_len)")
    shape = tuple(input_ids.shape)
    if labels is not None and tuple(labels.shape) != shape:
        raise InputShapeError(f"Expected labels of the shape of input_ids {shape}, got {tuple(labels.shape)}: "
                              "labels are the input ids themselves (the model shifts them), -100 where no loss is "
                              "taken")
    if attention_mask is not None and tuple(attention_mask.shape) != shape:
        raise InputShapeError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {shape}: they "
                              "must match")
    if position_ids is not None and tuple(position_ids.shape) not in (shape, (1, shape[1])):
        raise InputShapeError(f"position_ids has shape {tuple(position_ids.shape)}; TSP needs the full sequence's "
                              f"{shape} (or (1, {shape[1]}), shared by the rows), the same on every rank of the TSP "
                              "group")


def check_token_ids(input_ids, labels, vocab_size, num_classes=None):
    """Refuse ids outside ``[0, vocab_size)`` (the embedding's rows) and labels
    outside ``[0, num_classes)`` (the head's, by default ``vocab_size``) other
    than -100; ``input_ids`` or ``labels`` may be None. Host tensors: reading
    them costs no device wait."""
    num_classes = vocab_size if num_classes is None else num_classes
    for name, tensor, size, allowed in (("input_ids", input_ids, vocab_size, None),
                                        ("labels", labels, num_classes, IGNORE_INDEX)):
        if tensor is None:
            continue
        outside = (tensor < 0) | (tensor >= size)
        if allowed is not None:
            outside &= tensor != allowed
        if bool(outside.any()):
            first = tensor[outside][0].item()
            raise TokenIdError(f"{name} hold {int(outside.sum())} id(s) outside [0, vocab_size = {size})"
                               f"{' other than -100' if allowed is not None else ''} (e.g. {first}): check the "
                               "tokenizer and the model's vocabulary (resize_token_embeddings before ds_tsp.inject)")


def vocabulary_rows(module):
    """Rows of an embedding or classes of an LM head, sharded over the TSP group or not."""
    for name in ("vocab_size", "num_embeddings", "out_features"):
        if isinstance(getattr(module, name, None), int):
            return getattr(module, name)
    raise TypeError(f"{type(module).__name__} has no vocabulary size (vocab_size, num_embeddings or out_features)")


def left_padding(attention_mask, labels=None):
    """The host ``attention_mask``'s count of leading zeros per row ``(B,)``, or
    None when no row starts with padding. Refuses a label on a left-padded
    row's first real token: Hugging Face scores it from the padding token
    before it, which a TSP forward, moving the row, has no counterpart of."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    left = (attention_mask == 0).long().cumprod(dim=1).sum(dim=1)
    if not bool(left.any()):
        return None
    if bool((left == attention_mask.shape[1]).any()):
        raise ValueError("a row of attention_mask is all zeros: every row needs at least one real token")
    if labels is not None:
        first = labels.gather(1, left.clamp(max=labels.shape[1] - 1).unsqueeze(1)).squeeze(1)
        if bool(((left > 0) & (first != IGNORE_INDEX)).any()):
            raise ValueError("labels score the first real token of a left-padded row, which Hugging Face predicts "
                             "from a padding token: set labels to -100 there (TRL's trainers mask the prompt)")
    return left


def rows_left_aligned(left, input_ids, labels, position_ids, attention_mask):
    """The batch with each row's ``left`` leading padding tokens moved to its
    end, the real tokens keeping their positions (``position_ids``, Hugging
    Face's ``arange`` when None) and the moved padding continuing them."""
    batch, seq_len = input_ids.shape
    left = left.to(input_ids.device).unsqueeze(1)
    columns = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
    index = (columns + left) % seq_len

    def moved(t):
        return None if t is None else t.expand(batch, -1).gather(1, index)

    if position_ids is None:
        position_ids = columns
    real = moved(attention_mask).bool()
    positions = moved(position_ids)
    length = real.sum(dim=1, keepdim=True)
    last = positions.gather(1, (length - 1).clamp(min=0))
    positions = torch.where(real, positions, last + columns - length + 1)
    return moved(input_ids), moved(labels), positions, moved(attention_mask)
