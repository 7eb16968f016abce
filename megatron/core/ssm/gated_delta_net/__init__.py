"""Gated delta net (linear attention) layers: ``--experimental-attention-variant gdn``."""
