"""Text from token bytes. Tokens can split a character (byte-level BPE pieces, SentencePiece's <0xNN> fallback), and
a sampled answer can hold bytes that are no UTF-8 at all; neither may blank the stream or cut the drafter off."""

from __future__ import annotations

import codecs


def piece_decoder() -> codecs.IncrementalDecoder:
    """One per answer: `decode(new_bytes)` gives the text those bytes complete. It holds back only a valid incomplete
    ending (its rest may still come) and shows invalid bytes as U+FFFD, as the tokenizers' own decode does."""
    return codecs.getincrementaldecoder("utf-8")("replace")


def not_text(text: str) -> str | None:
    """What makes `text` no valid Unicode, or None: a lone surrogate (JSON's "\\ud800" escape carries one into a
    Python string), which no encoding can write and the tokenizers refuse."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate ({text[e.start]!r}) at character {e.start:,}"
    return None


def split_utf8(data: bytes) -> list[str | bytes]:
    """`data` as alternating runs of text (str) and invalid bytes (bytes), without a valid incomplete character at
    the very end: that one is held back, since its rest may still come."""
    runs: list[str | bytes] = []
    while data:
        try:
            runs.append(data.decode("utf-8"))
            break
        except UnicodeDecodeError as e:
            if e.start:
                runs.append(data[: e.start].decode("utf-8"))
            if e.reason == "unexpected end of data":  # a character cut off at the end, not an invalid one
                break
            runs.append(data[e.start : e.end])
            data = data[e.end :]
    return runs


def valid_prefix(data: bytes) -> str:
    """The text before the first invalid or incomplete byte."""
    runs = split_utf8(data)
    return runs[0] if runs and isinstance(runs[0], str) else ""


def inside_character(data: bytes, pos: int) -> bool:
    """Whether a cut of `data` at `pos` would split a character: the byte there continues one (0b10xxxxxx)."""
    return 0 < pos < len(data) and data[pos] & 0xC0 == 0x80
