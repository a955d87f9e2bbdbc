"""fedyogi: FedYogi (Reddi et al., 2021, Algorithm 2): Yogi's additive second-moment update on the server. (Family
``server_opt``; the class's docstring has the details.)"""

from __future__ import annotations

from fedskew.algorithms.base import Source, builtin
from fedskew.algorithms.server_opt import REDDI, AdaptiveOptions, ServerOpt


@builtin
class FedYogi(ServerOpt):
    """FedYogi (Reddi et al., 2021, Algorithm 2): Yogi's additive second-moment update on the server."""
    family = "server_opt"
    source = Source(**REDDI, implements="Algorithm 2 (FedYogi)")

    name, kind, Options = "fedyogi", "yogi", AdaptiveOptions
