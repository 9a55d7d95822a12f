"""Incremental detokenization of a growing id sequence (as SGLang's detokenizer streams text).

Owns: turning a growing id list into text in O(n). Must not: import any other Belayer module (the CPU engine
and the /generate front both use it, from different layers).
"""

from __future__ import annotations

from typing import Any


class IncrementalText:
    """The text of a growing list of ids, decoding only the ids added since the last call.

    A multi-byte character may span tokens, so each decode window keeps the previous call's ids as context,
    and text is held back while the window ends in an unfinished UTF-8 sequence (U+FFFD). Decoding the whole
    sequence per streamed token costs O(n^2) over a request; this costs O(n).
    """

    def __init__(self, tokenizer: Any):
        fast = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer: no Python-side overhead
        self._decode = fast.decode if fast is not None else tokenizer.decode
        self.text = ""
        self._prefix = 0  # where the last decode window started
        self._read = 0  # ids[:_read] are in text
        self._last = -1  # ids[_read - 1], to notice a list that was cut and regrown

    def update(self, ids: list[int]) -> str:
        """The text of `ids` so far. `ids` normally extends the previous call's; one that was cut (a stop
        string found across a resume truncates the output) starts the decoding over."""
        if self._read and (len(ids) < self._read or ids[self._read - 1] != self._last):
            self.text, self._prefix, self._read = "", 0, 0
        if self._read < len(ids):
            settled = self._decode(ids[self._prefix:self._read], skip_special_tokens=True)
            window = self._decode(ids[self._prefix:], skip_special_tokens=True)
            if len(window) > len(settled) and not window.endswith("\ufffd"):
                self.text += window[len(settled):]
                self._prefix, self._read = self._read, len(ids)
                self._last = ids[-1]
        return self.text
