"""Generation: SGLang HTTP client, context log, resumable generation, the drop-in /generate front."""
