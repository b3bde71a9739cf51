"""A transformers model's decoding context: its token ids and a transformers KV cache over all but the tail not yet
fed. Sliding-window layers record what they drop until the next crop; recurrent layers are snapshot instead
(`recurrent.py`)."""

from __future__ import annotations

import time

import torch

from ..kept import KeptLogits
from .recurrent import RecurrentStates, is_recurrent


class Context:
    def __init__(self, model, ids: list[int]):
        self.model = model
        self.ids = list(ids)
        self.cache = self._new_cache()
        self.cached = 0
        self.fed_since_crop = 0
        self.last = KeptLogits()
        self.forward_s = 0.0
        """Seconds spent inside model forwards: the rest of a round's time is the loop's own overhead."""

    def _new_cache(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        # Sliding-window layers (Gemma 3: 512 tokens) drop states that leave the window as they go; recording keeps
        # them until the next crop, so a rejected draft can be rolled back. Recurrent layers cannot be cropped at all:
        # their states are snapshot instead (recurrent.py).
        self.sliding = False
        for layer in cache.layers:
            if hasattr(layer, "activate_past_recording") and not is_recurrent(layer):
                layer.activate_past_recording()
                self.sliding = True
        recurrent = RecurrentStates(cache)
        self.recurrent = recurrent if recurrent.layers else None
        return cache

    def truncate(self, n: int) -> None:
        del self.ids[n:]
        self.last.drop_from(n)
        if self.cached > n:
            self._rollback(self.cached - n)

    def _rollback(self, drop: int) -> None:
        if self.sliding and drop > self.fed_since_crop:
            # A sliding-window layer kept only what was fed since its last crop: anything older is gone, so start
            # the cache again (rare: the drafter's resync never reaches behind the previous round).
            self._start_again()
        elif self.recurrent is not None:
            if self.recurrent.roll_back(self.cached - drop, drop):
                self.cached -= drop
            else:
                self._start_again()
        else:
            self.cache.crop(-drop)  # transformers 5: a negative count of tokens to drop
            self.cached -= drop
        self.fed_since_crop = 0

    def _start_again(self) -> None:
        self.cache, self.cached = self._new_cache(), 0

    @torch.inference_mode()
    def forward(self, keep: int = 0) -> torch.Tensor:
        """Feed every id the cache lacks; return the logits of the last `keep` of them (0: all) as [n, V] float32
        on the CPU. Asking only for what is needed matters: a 1,000-token prefill of a 150k vocabulary is 600 MB.
        One position more than is new may be asked for: the last one fed, whose logits are kept (`KeptLogits`)."""
        new = len(self.ids) - self.cached
        held, want = self.last.take(len(self.ids), keep or new)
        if held is not None and new == 0:
            return self.last.joined(held, None, len(self.ids))
        if held is None and new == 0:  # nothing new and nothing kept: re-feed the last token to get its logits again
            self._rollback(1)
        t0 = time.perf_counter()
        fresh = torch.tensor([self.ids[self.cached :]], device=self.model.device)
        out = self._run(fresh, want) if self.recurrent is None or self.cached == 0 else self._steps(fresh, want)
        self.fed_since_crop += len(self.ids) - self.cached
        self.cached = len(self.ids)
        logits = out[0].float().cpu()  # waits for the device, so the time below is the forward's
        self.forward_s += time.perf_counter() - t0
        return self.last.joined(held, logits, len(self.ids))

    def _run(self, fresh: torch.Tensor, keep: int) -> torch.Tensor:
        """One forward of the model over `fresh` ([1, n] ids) on this context's cache: the logits of its last `keep`
        positions (0: all), [1, n, V] on the model's device."""
        return self.model(input_ids=fresh, cache=self.cache, use_cache=True, logits_to_keep=keep).logits

    def _steps(self, fresh: torch.Tensor, keep: int) -> torch.Tensor:
        """`fresh` fed a token per forward, as plain decoding feeds a model with recurrent layers (recurrent.py), each
        after a snapshot of the states before it; the logits of the last `keep` (0: all)."""
        assert self.recurrent is not None
        rows = []
        for j in range(fresh.shape[1]):
            self.recurrent.take(self.cached + j)
            rows.append(self._run(fresh[:, j : j + 1], 1))
        out = torch.cat(rows, dim=1)
        return out[:, -keep:] if keep else out
