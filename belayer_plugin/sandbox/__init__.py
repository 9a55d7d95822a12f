"""Sandboxes: containers with full checkpoint/restore and prefix-consistent recovery."""
