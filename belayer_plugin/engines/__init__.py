"""Inference engines: the CPU engine server, the SGLang launcher, the engine Ray actor, the tiny model."""
