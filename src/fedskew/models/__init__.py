"""Backbones + classifiers with an addressable feature layer."""

from fedskew.models.build import MODEL_NAMES, build_model
from fedskew.models.nets import ModelError, SkewNet

__all__ = ["MODEL_NAMES", "ModelError", "SkewNet", "build_model"]
