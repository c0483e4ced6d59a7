"""Routing: who computes what. Pure tensor functions, no parameters, no imports of ours."""
