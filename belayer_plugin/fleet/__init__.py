"""The engine fleet: launch, router membership, health, restart policy, shadows, weight versions."""
