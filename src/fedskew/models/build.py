"""The model zoo by name: :func:`build_model` builds a ``model`` config section's backbone
(:mod:`~fedskew.models.nets`, :mod:`~fedskew.models.deep`, :mod:`~fedskew.models.text`) with the
section's heads (ETF classifier, projection head). A method's own architecture (FedConcat's
branches, FedDBE's shift, GPFL's valve, FedCP's policy, FLDA's private expert) is the method's
``Method.build_model``, applied by :func:`fedskew.algorithms.build_method_model`.
"""

from __future__ import annotations

import inspect

import torch

from fedskew.models.deep import DEEP_MODELS
from fedskew.models.nets import (
    ETFClassifier,
    ModelError,
    SkewNet,
    cnnbn,
    lenet,
    mlp,
    simplecnn,
    tcnn,
    with_projection_head,
)
from fedskew.models.text import lstm
from fedskew.streams import torch_seed


def _all_models() -> dict:
    return {"mlp": mlp, "lenet": lenet, "simplecnn": simplecnn, "tcnn": tcnn, "cnnbn": cnnbn, **DEEP_MODELS,
            "lstm": lstm}


MODEL_NAMES = tuple(_all_models())


FROM_BUILD = frozenset({"input_shape", "num_classes", "bias"})  # (bias: model.classifier_bias)


def model_keys(name: str) -> set[str]:
    """The ``model`` section's keys that model ``name``'s builder reads: its positional parameters
    other than :data:`FROM_BUILD` (``hidden`` of mlp and mlpnet, ``dropout`` of mlp, ``width`` of
    cnnbn; keyword-only ones are not configurable). ModelConfig.applies() reads them from here."""
    params = inspect.signature(_all_models()[name]).parameters.items()
    return {n for n, p in params if p.kind is not p.KEYWORD_ONLY} - FROM_BUILD


def build_model(cfg, input_shape: tuple[int, ...], num_classes: int, seed: int = 0) -> SkewNet:
    """Build the model of a :class:`fedskew.config.ModelConfig` for the data set's input shape;
    ``seed`` (the experiment's) fixes the ETF head when ``cfg.classifier == "etf"``."""
    models = _all_models()
    if cfg.name not in models:
        raise ModelError(f"model.name '{cfg.name}' is not known; allowed: {sorted(models)}.")
    kwargs = {"bias": cfg.classifier_bias}
    for key in model_keys(cfg.name):  # the builder's own default where the config has none (hidden)
        value = getattr(cfg, key)
        if value is not None:
            kwargs[key] = tuple(value) if isinstance(value, list) else value
    model = models[cfg.name](tuple(input_shape), num_classes, **kwargs)
    if cfg.projection_dim:
        model = with_projection_head(model, cfg.projection_dim, num_classes, cfg.classifier_bias)
    if getattr(cfg, "classifier", "linear") == "etf":
        if model.feature_dim < num_classes:
            fix = ("raise model.hidden's last width" if cfg.name == "mlp" and not cfg.projection_dim else
                   f"set model.projection_dim to {num_classes} or more")
            raise ModelError(f"model.classifier = 'etf' needs a feature dimension of at least the {num_classes} "
                             f"classes, but model '{cfg.name}' gives {model.feature_dim}; {fix}.")
        gen = torch.Generator().manual_seed(torch_seed(seed, "etf"))
        model.classifier = ETFClassifier(model.feature_dim, num_classes, gen, cfg.etf_scale, cfg.etf_normalize,
                                         cfg.etf_projector, cfg.etf_learn_scale)
        model.fixed_keys = frozenset({"classifier.weight"})
    return model


__all__ = ["MODEL_NAMES", "build_model", "model_keys"]
