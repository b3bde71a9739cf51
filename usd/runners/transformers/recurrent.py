"""Cache layers that hold a recurrent state (Mamba and other state-space or linear-attention layers, alone or in
hybrids such as Jamba) on the transformers runner (`pair.Context`), and how a context keeps them lossless.

Two facts about them, neither of which a KV cache has:
- Their state holds every token fed; it cannot be cropped back to an earlier position (transformers says so: such a
  layer is not `is_croppable` once it holds a recurrent state). So a context takes a snapshot of the states before each
  position it feeds after the prompt, and a rollback restores the snapshot of the position it goes back to; behind
  the snapshots kept, the cache is built again from nothing.
- A forward over several tokens after a cached prefix is not always the continuation of that prefix: some
  implementations (transformers 5's Mamba and Jamba) start its scan from a zero state. Plain decoding steps a token
  at a time, and a prompt is read from an empty state, where one forward is right. So after the prompt such a context
  feeds one token per forward, and every position is computed as plain decoding computes it: a verify of k drafts is
  k + 1 steps, so drafting cannot pay on such a target here, but it stays lossless.
"""

from __future__ import annotations

SNAPSHOTS = 40
"""Positions a context keeps a snapshot of: a verify of the longest draft and the drafter's resync back-off."""


def _classes():
    from transformers.cache_utils import (
        DynamicLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionAndSlidingWindowAttentionLayer,
        LinearAttentionCacheLayerMixin,
    )

    return (
        DynamicLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionAndSlidingWindowAttentionLayer,
        (LinearAttentionCacheLayerMixin),
    )


def is_recurrent(layer) -> bool:
    return isinstance(layer, _classes()[3])


class RecurrentStates:
    """The recurrent layers of one cache, and snapshots of their states by position (the tokens fed before it)."""

    FIELDS = (
        "conv_states",
        "recurrent_states",
        "has_previous_state",
        "is_conv_states_initialized",
        "is_recurrent_states_initialized",
    )

    def __init__(self, cache):
        self.cache = cache
        self.layers = [layer for layer in cache.layers if is_recurrent(layer)]
        self.snapshots: dict[int, list[dict]] = {}

    def take(self, position: int) -> None:
        """The states as they are with `position` tokens fed."""
        self.snapshots[position] = [
            {f: {i: _copy(v) for i, v in getattr(layer, f).items()} for f in self.FIELDS} for layer in self.layers
        ]
        while len(self.snapshots) > SNAPSHOTS:
            del self.snapshots[min(self.snapshots)]

    def roll_back(self, position: int, drop: int) -> bool:
        """Put the cache back to `position` tokens fed (`drop` fewer than it holds): the recurrent states from their
        snapshot, the attention layers cropped. False when that cannot be done (no snapshot of the position, or a
        layer whose sliding window cannot be rolled back with it): the caller builds the cache again."""
        DynamicLayer, hybrid_full, hybrid_sliding, _ = _classes()
        saved = self.snapshots.get(position)
        if saved is None or any(isinstance(layer, hybrid_sliding) for layer in self.cache.layers):
            return False
        for layer, states in zip(self.layers, saved, strict=True):
            for f, values in states.items():
                getattr(layer, f).update({i: _copy(v) for i, v in values.items()})  # copies: the layer writes in place
        for layer in self.cache.layers:
            if isinstance(layer, hybrid_full):
                DynamicLayer.crop(layer, -drop)  # its key/value half; the recurrent half came back above
            elif not is_recurrent(layer) and getattr(layer, "is_initialized", False):
                layer.crop(-drop)
        for later in [p for p in self.snapshots if p > position]:
            del self.snapshots[later]
        return True


def _copy(value):
    return value.clone() if hasattr(value, "clone") else value
