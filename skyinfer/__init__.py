"""skyinfer: a single-node inference service for RL post-training, built on vLLM engines."""

__version__ = "0.1.0"
