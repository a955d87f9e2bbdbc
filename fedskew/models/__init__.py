"""Backbones + classifiers with an addressable feature layer."""

from fedskew.models.nets import MODELS, ModelError, SkewNet, build_model

__all__ = ["MODELS", "ModelError", "SkewNet", "build_model"]
