"""Belayer: fault tolerance for agentic LLM RL training (engines, generation, sandboxes).

Owns: the package's version. Must not: import anything (every process imports it).
"""

__version__ = "0.1.0"
