"""GPU kernels we own (Triton), each with a pure-torch reference in the tests.

Leaves: nothing here imports the rest of ``mode``. Importing this package does not import
Triton; the kernel modules (``mod_tokens``, ``scatter_gemm``) do, and are imported only when a
backend asks for them. ``triton_unavailable_reason`` says why they cannot run somewhere.

- ``mod_tokens``: Mixture-of-Depths row gather ``[B, T, D] -> [B, k, D]`` and gated
  scatter-add ``x + g * y`` on the chosen rows, with fused backward passes.
- ``scatter_gemm``: ScatterMoE-style grouped GEMMs that read their input rows through the
  expert-sorted assignment index (no gathered ``[M, D]`` copy) and write their output back to
  token order with the router weights applied (the combine fused into the GEMM's epilogue).
"""

from mode.kernels.availability import interpreting, triton_missing_reason, triton_unavailable_reason

__all__ = ["interpreting", "triton_missing_reason", "triton_unavailable_reason"]
