"""Belayer's stand-in for `vllm._custom_ops`: the one name SGLang imports unguarded (see __init__.py)."""


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    # Stored as RotaryEmbedding.fallback_rotary_embedding but never called on CPU: the op dispatches to
    # forward_native there. Failing loudly keeps a wrong guess from silently changing outputs.
    raise RuntimeError(
        "vllm._custom_ops.rotary_embedding is a Belayer import stand-in; SGLang was expected to use its "
        "native rotary path on CPU"
    )
