"""lgfedavg: LG-FedAvg (Liang et al., 2020, Algorithm 1): local representations, global head. (Family ``sharing``;
the class's docstring has the details.)"""

from __future__ import annotations

from pydantic import Field

from fedskew.algorithms.base import FedAvgOptions, Source, builtin
from fedskew.algorithms.compose import PartialSharing


def layer_names(info) -> list[str]:
    """The model's parameterised layers (module paths), input to output, in parameter order."""
    layers: list[str] = []
    for name in info.param_names:
        layer = name.rsplit(".", 1)[0]
        if not layers or layers[-1] != layer:
            layers.append(layer)
    return layers


class LGFedAvgOptions(FedAvgOptions):
    search = {'global_layers': [1, 2]}  # the bench's search space (fedskew bench)
    global_layers: int = Field(1, ge=1, description="number of last parameterised layers shared and averaged "
                                                    "(official code's num_layers_keep; 1: the classifier)")


@builtin
class LGFedAvg(PartialSharing):
    """LG-FedAvg (Liang et al., 2020, Algorithm 1): local representations, global head. Each
    client keeps its own lower layers (the representation) and shares the last ``global_layers``
    parameterised layers, which the server averages. Every round the client trains its whole model
    from its own body and the received top layers. Personalised model: the client's body with the
    new top layers. The paper initialises from a FedAvg-trained model; here every client starts
    from the common initial model (documented difference). No global model (``global/*`` none):
    the server holds no body.

    Down and up: the top layers. Keeps the body per client."""
    family = "sharing"

    name = "lgfedavg"
    Options = LGFedAvgOptions
    source = Source(
        authors="Liang et al.",
        title="Think Locally, Act Globally: Federated Learning with Local and Global Representations",
        venue="arXiv preprint",
        year=2020,
        arxiv="2001.01523",
        implements="Algorithm 1",
        code="pliang279/LG-FedAvg")
    keep = "lg."
    has_global_model = False

    def __init__(self, options=None, info=None):
        super().__init__(options, info)
        layers = layer_names(info) if info is not None else []
        if info is not None and self.opt.global_layers >= len(layers):
            raise ValueError(f"method.global_layers = {self.opt.global_layers} is not allowed: the model has "
                             f"{len(layers)} parameterised layers and at least one must stay local")
        self._top = tuple(layers[-self.opt.global_layers:])

    def shared(self, key):
        return key.rsplit(".", 1)[0] in self._top
