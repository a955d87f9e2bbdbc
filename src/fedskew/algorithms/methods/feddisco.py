"""feddisco: FedDisco (Ye et al., ICML 2023): FedAvg aggregated with discrepancy-aware weights ReLU(p_k - a d_k +
b) (:class:`~fedskew.algorithms.components.Discrepancy`); any method that aggregates with FedAvg's weights takes
them as ``method.disco.disco_a=0.5`` (the paper pairs them with FedProx and MOON too). (Family ``server_opt``;
the class's docstring has the details.)"""

from __future__ import annotations

from fedskew.algorithms.base import FedAvgOptions, Source, builtin
from fedskew.algorithms.components import DiscoOptions, Discrepancy
from fedskew.algorithms.compose import Composed, options_of


class FedDiscoOptions(DiscoOptions, FedAvgOptions):
    pass


@builtin
class FedDisco(Composed):
    """FedDisco (Ye et al., ICML 2023): FedAvg aggregated with discrepancy-aware weights
    ReLU(p_k - a d_k + b) (:class:`~fedskew.algorithms.components.Discrepancy`); any method that
    aggregates with FedAvg's weights takes them as ``method.disco.disco_a=0.5`` (the paper pairs
    them with FedProx and MOON too). Sends what FedAvg does."""
    family = "server_opt"

    name = "feddisco"
    Options = FedDiscoOptions
    source = Source(
        authors="Ye et al.",
        title="FedDisco: Federated Learning with Discrepancy-Aware Collaboration",
        venue="ICML",
        arxiv="2305.19229", year=2023,
        implements="Eq. 3-4 (discrepancy-aware aggregation weights)",
        code="MediaBrain-SJTU/FedDisco")

    def parts(self, opt):
        return [Discrepancy(options_of(DiscoOptions, opt))]
