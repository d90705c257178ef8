"""Learned and adaptive normalization layers as first-class detectron2 norm types."""

__version__ = "0.1.0"
