"""ds_tsp's autograd Functions under ``torch.compile``: each runs eager, as one call.

Their forwards and backwards post collectives asynchronously (a ring's p2p
steps, all-gathers waited under the next head group's compute) or copy to and
from host memory, which TorchDynamo cannot trace: it broke them into many graphs,
inside the schedules' loops (at TSP 2 a Llama layer became 26 graphs, a
DeepSeek-V3 expert layer 42 to 45, the count differing between ranks).
Dynamo does not enter an ``EagerFunction``: a compiled TSP model's graph
breaks once at each such call and is compiled between them (the norms,
residuals, routers and rotary tables around the schedules)."""

import torch


class EagerFunction(torch.autograd.Function):
    """A ``torch.autograd.Function`` that ``torch.compile`` calls as it is, untraced (module docstring)."""

    @classmethod
    @torch.compiler.disable
    def apply(cls, *args, **kwargs):
        return super().apply(*args, **kwargs)
