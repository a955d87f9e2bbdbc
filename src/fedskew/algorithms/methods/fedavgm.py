"""fedavgm: FedAvgM (Hsu et al., 2019): server momentum over the pseudo-gradient, m <- beta m + Delta. (Family
``server_opt``; the class's docstring has the details.)"""

from __future__ import annotations

from fedskew.algorithms.base import Source, builtin
from fedskew.algorithms.server_opt import ServerOpt


@builtin
class FedAvgM(ServerOpt):
    """FedAvgM (Hsu et al., 2019): server momentum over the pseudo-gradient, m <- beta m + Delta."""
    family = "server_opt"
    source = Source(
        authors="Hsu, Qi, Brown",
        title="Measuring the Effects of Non-Identical Data Distribution for Federated Visual Classification",
        venue="arXiv preprint",
        year=2019,
        arxiv="1909.06335",
        implements="server momentum on the pseudo-gradient (Section 3)",
        code="no official code; the paper's server momentum")

    name, kind = "fedavgm", "avgm"
