"""Inference engines: the CPU engine server, the SGLang launcher, the engine Ray actor, the tiny model.

Owns: nothing beyond the package. Must not: import its modules eagerly (an engine process imports only what it
serves with).
"""
