"""fedadagrad: FedAdagrad (Reddi et al., 2021, Algorithm 2): Adagrad on the server, v <- v + Delta^2. (Family
``server_opt``; the class's docstring has the details.)"""

from __future__ import annotations

from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Source, builtin
from fedskew.algorithms.server_opt import REDDI, ServerOpt


class AdagradOptions(FedAvgOptions):
    """FedAdagrad has no second-moment decay: v accumulates every Delta^2."""
    search = {'server_lr': [0.003, 0.01, 0.03]}  # the bench's search space (fedskew bench)
    server_lr: float = Field(0.01, gt=0, description="eta_g (Reddi et al. tune 1e-3..1e-1)")
    beta1: float = Field(0.0, ge=0, lt=1, description="first-moment decay (0: no server momentum, Flower's "
                                                      "FedAdagrad; Algorithm 2 allows any)")
    tau: float = Field(1e-3, gt=0, description="adaptivity; v starts at tau^2")


@builtin
class FedAdagrad(ServerOpt):
    """FedAdagrad (Reddi et al., 2021, Algorithm 2): Adagrad on the server, v <- v + Delta^2."""
    family = "server_opt"
    source = Source(**REDDI, implements="Algorithm 2 (FedAdagrad)")

    name, kind, Options = "fedadagrad", "adagrad", AdagradOptions
