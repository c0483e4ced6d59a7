"""Experts: how routed tokens are computed (permutation, grouped GEMM, expert MLPs, MoE layers)."""
