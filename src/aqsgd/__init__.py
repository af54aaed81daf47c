"""aqsgd: pipeline-parallel training over slow networks with compressed activations and gradients."""

__version__ = "0.1.0"
