"""Backbones + classifiers with an addressable feature layer."""

from fedskew.models.nets import MODEL_NAMES, ModelError, SkewNet, build_model

__all__ = ["MODEL_NAMES", "ModelError", "SkewNet", "build_model"]
