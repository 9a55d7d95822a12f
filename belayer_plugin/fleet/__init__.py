"""The engine fleet: launch, router membership, health, restart policy, shadows, weight versions.

Owns: nothing beyond the package. Must not: import its modules eagerly.
"""
