"""Hyper-connected residual streams (HY-V4's, ``policy.HyperConnections``):
the decoder layers carry ``hc_mult`` streams ``(B, L, hc_mult, H)`` of every
token, the embedding repeated into them, and the model's own module mixes
them back into one before the final norm. Per token: nothing moves between ranks."""


def into_streams(model, hidden):
    """The embedded tokens ``(B, L, H)`` as the decoder layers take them: repeated into ``hc_mult`` streams
    ``(B, L, hc_mult, H)`` where the model's residual is several, else as they are."""
    if model.tsp_policy.model_streams(model) is None:
        return hidden
    return hidden.unsqueeze(2).expand(-1, -1, model.config.get_text_config().hc_mult, -1).contiguous()


def out_of_streams(model, hidden):
    """The last layer's output as the final norm takes it: its streams mixed into one by the model's own module
    (HY-V4's ``hc_head``), where it has several."""
    streams = model.tsp_policy.model_streams(model)
    return hidden if streams is None else model.get_submodule(streams.head)(hidden)
