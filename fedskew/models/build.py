"""The model zoo by name: :func:`build_model` builds a ``model`` config section's backbone
(:mod:`~fedskew.models.nets`, :mod:`~fedskew.models.deep`, :mod:`~fedskew.models.text`) and the
heads and parts a method's architecture adds (ETF classifier, projection head, FedConcat's
branches, FedDBE's shift, GPFL's valve, FedCP's policy, a private expert).
"""

from __future__ import annotations

import torch
from torch import nn

from fedskew.models.deep import DEEP_MODELS
from fedskew.models.nets import (Branches, ConditionalPolicy, ConditionalValve, ETFClassifier, ModelError,
                                 PrivateExpertNet, SkewNet, cnnbn, lenet, mlp, simplecnn, tcnn, with_projection_head)
from fedskew.models.text import lstm
from fedskew.streams import torch_seed

def _all_models() -> dict:
    return {"mlp": mlp, "lenet": lenet, "simplecnn": simplecnn, "tcnn": tcnn, "cnnbn": cnnbn, **DEEP_MODELS,
            "lstm": lstm}


MODEL_NAMES = ("mlp", "lenet", "simplecnn", "tcnn", "cnnbn", "mlpnet", "tfcnn", "vgg8", "vgg8bn", "vgg11",
               "vgg16bn", "resnet18", "resnet20", "resnet56", "wrn28_10", "resnet50", "efficientnet_b0", "lstm")


def build_model(cfg, input_shape: tuple[int, ...], num_classes: int, seed: int = 0) -> SkewNet:
    """Build the model of a :class:`fedskew.config.ModelConfig` for the data set's input shape;
    ``seed`` (the experiment's) fixes the ETF head when ``cfg.classifier == "etf"``."""
    models = _all_models()
    if cfg.name not in models:
        raise ModelError(f"model.name '{cfg.name}' is not known; allowed: {sorted(models)}.")
    kwargs = {"bias": cfg.classifier_bias}
    if cfg.name in ("mlp", "mlpnet") and cfg.hidden is not None:
        kwargs["hidden"] = tuple(cfg.hidden)
    if cfg.name == "mlp" and cfg.dropout:
        kwargs["dropout"] = cfg.dropout
    if cfg.name == "cnnbn":
        kwargs["width"] = cfg.width
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
    if getattr(cfg, "branches", 1) > 1:  # K - 1 more backbones of the same configuration, drawn next
        if cfg.classifier != "linear" or cfg.private_expert:
            raise ModelError("model.branches > 1 (FedConcat's architecture) takes model.classifier = 'linear' and "
                             "model.private_expert = false")
        one = cfg.model_copy(update={"branches": 1})
        backbones = [model.backbone] + [build_model(one, input_shape, num_classes, seed).backbone
                                        for _ in range(cfg.branches - 1)]
        model = SkewNet(Branches(backbones), cfg.branches * model.feature_dim, num_classes, cfg.classifier_bias)
    if getattr(cfg, "feature_shift", False):  # zeros, as FedDBE's client_mean starts
        if cfg.private_expert:
            raise ModelError("model.feature_shift (FedDBE's architecture) takes model.private_expert = false")
        model.shift = nn.Parameter(torch.zeros(model.feature_dim))
    if getattr(cfg, "conditional_valve", False):  # GPFL: CoV, then the category embeddings (GCE)
        if cfg.classifier != "linear" or cfg.private_expert or cfg.feature_shift:
            raise ModelError("model.conditional_valve (GPFL's architecture) takes model.classifier = 'linear', "
                             "model.private_expert = false and model.feature_shift = false")
        model.valve = ConditionalValve(model.feature_dim)
        model.gce = nn.Embedding(num_classes, model.feature_dim)
    if getattr(cfg, "conditional_policy", False):  # FedCP: the CPN and a global head equal to the head at first
        if cfg.classifier != "linear" or cfg.private_expert or cfg.feature_shift or cfg.conditional_valve:
            raise ModelError("model.conditional_policy (FedCP's architecture) takes model.classifier = 'linear', "
                             "model.private_expert = false, model.feature_shift = false and "
                             "model.conditional_valve = false")
        model.policy = ConditionalPolicy(model.feature_dim, num_classes, cfg.classifier_bias)
        model.policy.head_g.load_state_dict(model.classifier.state_dict())  # the official head_g = deepcopy(head)
    if getattr(cfg, "private_expert", False):  # a second model of the same configuration, drawn next
        model = PrivateExpertNet(model, build_model(cfg.model_copy(update={"private_expert": False}), input_shape,
                                                    num_classes, seed))
    return model


__all__ = ["MODEL_NAMES", "build_model"]
