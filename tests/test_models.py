import pytest
import torch

from fedskew.config import ModelConfig
from fedskew.models import ModelError, build_model


@pytest.mark.parametrize("name,shape,feat", [
    ("mlp", (1, 8, 8), 200), ("mlp", (60,), 200), ("lenet", (1, 28, 28), 256), ("lenet", (3, 32, 32), 400),
    ("simplecnn", (1, 28, 28), 84), ("simplecnn", (3, 32, 32), 84), ("tcnn", (1, 8, 8), 512),
    ("tcnn", (3, 32, 32), 512), ("cnnbn", (1, 8, 8), 128), ("cnnbn", (1, 28, 28), 128)])
def test_forward_shapes_and_feature_dims(name, shape, feat):
    model = build_model(ModelConfig(name=name), shape, 7)
    x = torch.randn(5, *shape)
    z, logits = model(x, return_features=True)
    assert z.shape == (5, feat) and logits.shape == (5, 7) and model.feature_dim == feat
    model.eval()  # (in train mode a BatchNorm model's two calls see different running statistics)
    z_eval, logits_eval = model(x, return_features=True)
    assert torch.equal(model(x), logits_eval)  # the plain call is the classifier on the same features
    assert torch.allclose(model.classifier(z_eval), logits_eval)
    names = [n for n, _ in model.named_parameters()]
    assert all(n.startswith(("backbone.", "classifier.")) for n in names)


def test_classifier_without_bias():
    model = build_model(ModelConfig(name="mlp", classifier_bias=False), (1, 8, 8), 10)
    assert model.classifier.bias is None


def test_mlp_hidden_widths():
    model = build_model(ModelConfig(name="mlp", hidden=[32, 16, 8]), (4,), 3)
    assert model.feature_dim == 8 and len([m for m in model.backbone if isinstance(m, torch.nn.Linear)]) == 3


def test_too_small_images_are_a_clear_error():
    with pytest.raises(ModelError, match="cannot take 8x8 images"):
        build_model(ModelConfig(name="lenet"), (1, 8, 8), 10)
    with pytest.raises(ModelError, match="needs image inputs"):
        build_model(ModelConfig(name="tcnn"), (60,), 10)
