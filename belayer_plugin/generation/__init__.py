"""Generation: SGLang HTTP client, context log, resumable generation, the drop-in /generate front.

Owns: nothing beyond the package. Must not: import its modules eagerly.
"""
