"""fedadam: FedAdam (Reddi et al., 2021, Algorithm 2): Adam on the server, no bias correction. (Family
``server_opt``; the class's docstring has the details.)"""

from __future__ import annotations

from fedskew.algorithms.base import Source, builtin
from fedskew.algorithms.server_opt import REDDI, AdaptiveOptions, ServerOpt


@builtin
class FedAdam(ServerOpt):
    """FedAdam (Reddi et al., 2021, Algorithm 2): Adam on the server, no bias correction."""
    family = "server_opt"
    source = Source(**REDDI, implements="Algorithm 2 (FedAdam)")

    name, kind, Options = "fedadam", "adam", AdaptiveOptions
