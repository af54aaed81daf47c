"""Model definitions bundled with aqsgd (models not provided by transformers)."""

from aqsgd.models.resnet import BasicBlock, ResNet, ResNetHead

__all__ = ["BasicBlock", "ResNet", "ResNetHead"]
