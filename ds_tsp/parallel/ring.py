"""Weight shards round a ring: the schedule the gated MLP (DESIGN.md 5) and the
vocabulary-parallel LM head (DESIGN.md 6) share.

Every rank starts with its own shard; at step ``t`` rank ``r`` holds shard
``(r - t) mod D`` and computes with it on its own tokens while the next shard is
already on its way from ``r - 1``. Tokens never move.

In backward the partial gradient of a shard, from one rank's tokens, must end
summed over all ranks on the shard's owner. At ``t=0`` each rank keeps the
partial of its own shard; from ``t=1`` the accumulator of the shard a rank
holds travels with that shard (posted with the next weight hop, added to on
arrival), and after the last step it makes one more hop, to the owner, which
adds the partial it kept. Per rank: ``D-1`` weight hops and ``D-1``
accumulator hops, no all-reduce, no broadcast.

The accumulators are sums in float32 (or wider) on every rank; they travel in
the gradient wire dtype (``precision.gradient_wire_dtype``: float32 unless
DeepSpeed's ``communication_data_type`` says otherwise), rounded to it only to
be sent, and are added to the receiver's unrounded partial on arrival.
"""

import dataclasses

from ds_tsp.parallel import comm


def ring_steps(shard, tsp_group, step, overlap=True):
    """Call ``step(t, buf)`` for ``t`` in ``0..D-1``, ``buf`` holding shard
    ``(r - t) mod D``; the next shard's hop overlaps the step when ``overlap``."""
    tsp_size = comm.group_size(tsp_group)
    ring = comm.RingExchange(tsp_group) if tsp_size > 1 else None
    buf = shard
    for t in range(tsp_size):
        if t < tsp_size - 1:
            next_buf = ring.send_recv(buf)
            ring.commit() if overlap else ring.wait()
        step(t, buf)
        if t < tsp_size - 1:
            ring.wait()
            buf = next_buf


def ring_gradients(shard, tsp_group, step, overlap=True, wire_dtype=None):
    """Run the ring again for backward: ``step(t, buf)`` returns the partial
    gradient of the shard in ``buf`` from this rank's tokens (shaped like
    ``buf``, in the dtype it is summed in). The accumulators travel in
    ``wire_dtype`` (default: that dtype). Returns this rank's own shard's
    gradient summed over every rank of the group, in the partials' dtype."""
    tsp_size = comm.group_size(tsp_group)
    if tsp_size == 1:
        return step(0, shard)
    ring = comm.RingExchange(tsp_group)
    buf, own_partial, acc = shard, None, None
    for t in range(tsp_size):  # buf holds shard (r - t) mod D; acc its gradient so far
        if t < tsp_size - 1:
            next_buf = ring.send_recv(buf)
        if acc is not None:
            # The accumulator of the shard held at t-1 follows it to r+1; ours arrives from r-1.
            next_acc = ring.send_recv(acc.to(wire_dtype or acc.dtype))
        ring.commit() if overlap else ring.wait()
        partial = step(t, buf)
        ring.wait()
        if t == 0:
            own_partial = partial
        elif t == 1:
            acc = partial
        else:
            acc = partial + next_acc  # in the partial's dtype, whatever the wire's
        if t < tsp_size - 1:
            buf = next_buf
    # After step D-1 rank r holds shard r+1: one last hop hands its sum to the owner.
    next_acc = ring.send_recv(acc.to(wire_dtype or acc.dtype))
    ring.wait()
    return own_partial + next_acc


class RingWireDtypeMixin:
    """``grad_wire_dtype`` of a module whose ring plan (``self.plan``, a frozen
    dataclass) carries it: the dtype the ring's gradient accumulators travel
    in; None: float32 (or wider). ``ds_tsp.initialize`` sets DeepSpeed's
    ``communication_data_type`` here when the config names it."""

    @property
    def grad_wire_dtype(self):
        return self.plan.grad_wire_dtype

    @grad_wire_dtype.setter
    def grad_wire_dtype(self, dtype):
        self.plan = dataclasses.replace(self.plan, grad_wire_dtype=dtype)
