"""usd: universal speculative decoding, lossless across vocabularies."""

__version__ = "0.1.0"
