"""Belayer's stand-in for `vllm` (see sglang_standins/README.md).

SGLang 0.5.23's RotaryEmbedding, on a device that is neither CUDA, HIP nor SGLang's CPU engine
(SGLANG_USE_CPU_ENGINE=1 needs sgl-kernel's CPU build, not installable here), imports
`vllm._custom_ops.rotary_embedding` unconditionally as a fallback kernel at construction time. Every other
vllm import in SGLang is guarded by `except ImportError`, so this package deliberately holds nothing but
`_custom_ops` with that one name: the guarded imports keep failing and SGLang keeps its native paths.
"""

__version__ = "0.0.0+belayer.standin"
