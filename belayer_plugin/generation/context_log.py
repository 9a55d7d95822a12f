"""The context log of one generation request: the tokens committed so far and where each came from.

Committed tokens are never regenerated: after a failure the request resumes from prompt + committed ids
(token ids, never re-tokenised text, which does not round-trip), and their logprobs are kept as they were.

Owns: a request's committed tokens and their segments (engine, version). Must not: do I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Segment:
    """A run of tokens produced by one engine incarnation under one weight version."""

    engine: str
    url: str
    weight_version: str
    start: int  # index of the segment's first token in the output
    end: int
    seed: Optional[int]
    outcome: str = "running"  # running | finished | failed: <reason>
    t_start: float = field(default_factory=time.time)  # wall clock (the report draws segments on lanes)
    t_end: float = 0.0


@dataclass
class ContextLog:
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    want_logprobs: bool = True
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[Optional[float]] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    finish_reason: Optional[dict] = None

    @property
    def committed(self) -> int:
        return len(self.output_ids)

    @property
    def remaining(self) -> int:
        return max(0, self.max_new_tokens - self.committed)

    def resume_input_ids(self) -> list[int]:
        """What the next engine is given: the prompt and every committed token."""
        return self.prompt_ids + self.output_ids

    def begin(self, engine: str, url: str, seed: Optional[int]) -> Segment:
        seg = Segment(engine, url, "", self.committed, self.committed, seed)
        self.segments.append(seg)
        return seg

    def append(self, seg: Segment, new_ids: list[int], new_logprobs: Optional[list[Any]],
               weight_version: Optional[str]) -> int:
        """Commits tokens that follow everything committed so far; returns how many."""
        if not new_ids:
            return 0
        if new_logprobs is not None and len(new_logprobs) >= len(new_ids):
            lps = [_lp(x) for x in new_logprobs[: len(new_ids)]]
        else:
            lps = [None] * len(new_ids)
        self.output_ids.extend(new_ids)
        self.logprobs.extend(lps)
        seg.end += len(new_ids)
        if weight_version:
            seg.weight_version = weight_version
        return len(new_ids)

    def commit(self, seg: Segment, segment_ids: list[int], segment_logprobs: Optional[list[Any]],
               weight_version: Optional[str]) -> int:
        """Commits a segment's cumulative output (SGLang stream chunks are cumulative); returns the new count."""
        have = seg.end - seg.start
        lps = segment_logprobs[have:] if segment_logprobs is not None else None
        return self.append(seg, segment_ids[have:], lps, weight_version)

    def truncate(self, n: int) -> None:
        """Keeps the first n committed tokens (a stop string matched inside the last chunk)."""
        drop = self.committed - n
        if drop <= 0:
            return
        del self.output_ids[n:]
        del self.logprobs[n:]
        if self.segments:
            self.segments[-1].end -= drop

    def restart(self) -> None:
        """Drops every committed token: the request goes again from its prompt (resume was refused)."""
        self.output_ids.clear()
        self.logprobs.clear()

    def summary(self) -> dict:
        return {"segments": [s.__dict__ for s in self.segments], "attempts": len(self.segments),
                "resumed_from": [s.start for s in self.segments[1:]]}


def _lp(x: Any) -> Optional[float]:
    # SGLang gives [logprob, token_id, text-or-None] triples
    if isinstance(x, (list, tuple)) and x:
        return None if x[0] is None else float(x[0])
    return None if x is None else float(x)
