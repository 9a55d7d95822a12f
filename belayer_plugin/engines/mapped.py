"""Tensors that view a copy-on-write mapping of a file (no read, no copy): how engines load weights.

Engines that map the same file share its page cache. A file truncated in place while mapped kills the process
with SIGBUS on the next access (so does transformers 5, checked), so writers publish new weights by rename, as
the learner and the shared-memory holder do.

Owns: mapping weight files into tensors copy-on-write. Must not: import transformers or any Belayer module.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path
from typing import Any

# name -> (torch dtype attribute name, shape, byte offset in the file, byte length)
Entries = dict[str, tuple[str, list[int], int, int]]


def map_tensors(file: str | Path, entries: Entries) -> dict[str, Any]:
    """The entries' tensors over one mapping of `file`; ValueError naming the first entry that has an unknown
    dtype, lies outside the file or has the wrong length, checked before anything is mapped."""
    import torch

    size = os.stat(file).st_size
    for name, (dtype_name, shape, offset, nbytes) in entries.items():
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{file}: tensor {name!r} has an unknown dtype {dtype_name!r}")
        if not (0 <= offset <= offset + nbytes <= size) or nbytes != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{file}: tensor {name!r} lies outside the file or has the wrong size")
    if not any(nbytes for *_, nbytes in entries.values()):  # nothing to map (mmap refuses an empty file)
        return {name: torch.empty(shape, dtype=getattr(torch, d)) for name, (d, shape, _, _) in entries.items()}
    fd = os.open(file, os.O_RDONLY)
    try:
        # Copy-on-write: pages stay shared with every other mapper as long as nobody writes them. Each tensor
        # holds a reference to the mapping, which lives as long as any of them.
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    out = {}
    for name, (d, shape, offset, nbytes) in entries.items():
        dtype = getattr(torch, d)
        out[name] = (torch.frombuffer(mm, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset) if nbytes
                     else torch.empty(0, dtype=dtype)).view(shape)
    return out
