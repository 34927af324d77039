"""Incremental stop-string detection: each step decodes and searches only a request's new text.

A request stops at the first step where its decoded output (`tokenizer.decode(generated)`) contains one
of its stop strings. Rather than decoding the whole output every step, each request keeps the point up
to which its text is settled, decodes only the tokens after it (with the previous chunk as context, so
tokenizers that treat a sequence's first token specially decode the same), and searches the new text
plus a holdback of the settled text's last `max(len(stop)) - 1` characters: every new occurrence ends in
the new text, so it starts inside that window. Text holding U+FFFD (an incomplete or undecodable byte
sequence) is searched but not settled, so later tokens completing a character are decoded with it.
This equals the whole-output check for tokenizers whose decoding of a sequence is the decoding of its
chunks joined at settled points (byte-level BPE; SentencePiece with the context chunk); a request whose
settled text stops being a prefix of its re-decoded window is checked on its whole output from then on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

REPLACEMENT = "\ufffd"


@dataclass
class _Progress:
    """One request's settled text: tokens `[:read]` are settled; `[context:read]` decode the last chunk."""

    context: int = 0
    read: int = 0
    holdback: str = ""  # the settled text's last `max stop length - 1` characters
    whole: bool = False  # the tokenizer's chunks did not join: check the whole output from now on


class StopStringDetector:
    """Tells, per step, whether a request's output text now contains one of its stop strings."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._progress: dict[int, _Progress] = {}

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def found(self, uid: int, generated: Sequence[int], stops: Sequence[str]) -> bool:
        """True when `decode(generated)` contains a stop string; `generated` only grows between calls."""
        progress = self._progress.setdefault(uid, _Progress())
        if progress.whole:
            text = self._decode(generated)
            return any(stop in text for stop in stops)
        settled = self._decode(generated[progress.context : progress.read])
        window = self._decode(generated[progress.context :])
        if not window.startswith(settled):
            progress.whole = True
            return self.found(uid, generated, stops)
        text = progress.holdback + window[len(settled) :]
        if REPLACEMENT not in text:  # settle it (else wait for the tokens that complete its characters)
            keep = max(map(len, stops)) - 1
            progress.holdback = text[-keep:] if keep else ""
            progress.context, progress.read = progress.read, len(generated)
        return any(stop in text for stop in stops)

    def drop(self, uid: int) -> None:
        """Forgets request `uid` (it has finished)."""
        self._progress.pop(uid, None)
