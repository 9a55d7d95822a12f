"""Trainer hooks: Belayer inside verl (hooks/verl) and NeMo-RL (hooks/nemo_rl), shipped as belayer_plugin.hooks.

Owns: nothing beyond the package. Must not: import a trainer (each hook imports its own).
"""

