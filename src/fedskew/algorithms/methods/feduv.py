"""feduv: FedUV (Son et al., CVPR 2024; sonhamin/FedUV): FedAvg + the classifier-variance and
hyperspherical-uniformity regularisers (:class:`~fedskew.algorithms.components.UniformityVariance`); any other
method takes them as ``method.uv.std_coeff=2.5``. (Family ``representation``; the class's docstring has the
details.)"""

from __future__ import annotations

from fedskew.algorithms.base import FedAvgOptions, Source, builtin
from fedskew.algorithms.components import UniformityVariance, UVOptions
from fedskew.algorithms.compose import Composed, options_of


class FedUVOptions(UVOptions, FedAvgOptions):
    pass


@builtin
class FedUV(Composed):
    """FedUV (Son et al., CVPR 2024; sonhamin/FedUV): FedAvg + the classifier-variance and
    hyperspherical-uniformity regularisers (:class:`~fedskew.algorithms.components.UniformityVariance`);
    any other method takes them as ``method.uv.std_coeff=2.5``. Sends and keeps what FedAvg does."""
    family = "representation"

    name = "feduv"
    Options = FedUVOptions
    source = Source(
        authors="Son et al.",
        title="FedUV: Uniformity and Variance for Heterogeneous Federated Learning",
        venue="CVPR",
        arxiv="2402.18372", year=2024,
        implements="the classifier-variance and hyperspherical-uniformity regularisers (the paper's Section 4)",
        code="sonhamin/FedUV")

    def parts(self, opt):
        return [UniformityVariance(options_of(UVOptions, opt))]
