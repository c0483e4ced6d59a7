"""mode-moe: Mixture-of-Depths-and-Experts layers and models for PyTorch (import name ``mode``)."""

from mode.config import Config, load_config
from mode.experts.moe import CapacityMoE, DroplessMoE
from mode.layers.blocks import DenseBlock, IntegratedMoDEBlock, MoDBlock, MoEBlock, StagedMoDEBlock
from mode.model import MoDETransformer
from mode.routed import aux_loss, routing_metrics

__version__ = "0.1.0"

__all__ = [
    "CapacityMoE",
    "Config",
    "DenseBlock",
    "DroplessMoE",
    "IntegratedMoDEBlock",
    "MoDBlock",
    "MoEBlock",
    "StagedMoDEBlock",
    "MoDETransformer",
    "aux_loss",
    "load_config",
    "routing_metrics",
    "__version__",
]
