"""ds_tsp under ``torch.compile``: its autograd Functions and a step's host-side bookkeeping run eager.

Their forwards and backwards post collectives asynchronously (a ring's p2p
steps, all-gathers waited under the next head group's compute) or copy to and
from host memory, which TorchDynamo cannot trace: it broke them into many graphs,
inside the schedules' loops (at TSP 2 a Llama layer became 26 graphs, a
DeepSeek-V3 expert layer 42 to 45, the count differing between ranks).
Dynamo calls an ``EagerFunction`` as it is: a compiled TSP model's graph
breaks once at each such call (the break's reason, in ``torch._dynamo.explain``,
is the first thing in the schedule it could not trace) and is compiled between
them (the norms, residuals, routers and rotary tables around the schedules). ``untraced``
keeps a step's host-side bookkeeping out of the traced code too."""

import torch


class EagerFunction(torch.autograd.Function):
    """A ``torch.autograd.Function`` that ``torch.compile`` calls as it is, untraced (module docstring)."""

    @classmethod
    @torch.compiler.disable
    def apply(cls, *args, **kwargs):
        return super().apply(*args, **kwargs)


def untraced(function):
    """``function`` called as it is under ``torch.compile``: a step's host-side bookkeeping (the batch's host
    copy and the routes read from it, the byte counter), whose Python numbers change every step and, traced,
    would be guards that recompile the model at every step."""
    return torch.compiler.disable(function)
