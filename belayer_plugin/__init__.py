"""Belayer: fault tolerance for agentic LLM RL training (engines, generation, sandboxes)."""

__version__ = "0.1.0"
