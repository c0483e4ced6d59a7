"""mode-moe: Mixture-of-Depths-and-Experts layers and models for PyTorch (import name ``mode``)."""

from mode.config import Config, load_config
from mode.experts.moe import CapacityMoE, DroplessMoE, ExpertChoiceMoE, MoEConfig
from mode.layers.arch import Arch
from mode.layers.blocks import DenseBlock, IntegratedMoDEBlock, MoEBlock
from mode.layers.early_exit import EarlyExitConfig
from mode.layers.mod import MoDBlock, RandomMoDBlock, RoutingConfig, StagedMoDEBlock
from mode.model import MoDETransformer
from mode.routed import after_optimizer_step, aux_loss, routing_metrics

__version__ = "0.1.0"

__all__ = [
    "Arch",
    "CapacityMoE",
    "Config",
    "DenseBlock",
    "DroplessMoE",
    "EarlyExitConfig",
    "ExpertChoiceMoE",
    "IntegratedMoDEBlock",
    "MoDBlock",
    "MoEBlock",
    "MoEConfig",
    "RandomMoDBlock",
    "RoutingConfig",
    "StagedMoDEBlock",
    "MoDETransformer",
    "aux_loss",
    "load_config",
    "routing_metrics",
    "after_optimizer_step",
    "__version__",
]
