"""Pieces shared by the model families (rotary embeddings)."""
