"""How experts spread over ranks: process groups, all-to-all, the expert-parallel dispatcher,
data-parallel wrapping and sharded checkpoints. Import explicitly (``mode.parallel.mesh`` etc.);
model code never imports this package."""

from mode.parallel.expert_parallel import ExpertParallelDispatcher, parallelize
from mode.parallel.mesh import ParallelContext, destroy, init_mesh

__all__ = ["ExpertParallelDispatcher", "ParallelContext", "destroy", "init_mesh", "parallelize"]
