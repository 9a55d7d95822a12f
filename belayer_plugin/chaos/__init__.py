"""Fault injection for chaos recipes. Imported only when `belayer.chaos.enabled` is true; it acts from
outside, with real signals and container kills, never through hooks on production classes.

Owns: the chaos package's entry. Must not: be imported by anything that runs without chaos.enabled.
"""
