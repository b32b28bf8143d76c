"""Dynamic loss scaling for FP16: the seed's policy, as an immutable state with two transitions.

The summed masked loss of a window is multiplied by `scale` before backward; the accumulated
gradients are divided by `scale * scored_tokens` before clipping. A non-finite gradient anywhere
discards the window's gradients, halves the scale and replays the same examples; no optimizer
update and no token count is committed. After `GROWTH_INTERVAL` successful updates the scale
doubles. Bounds: 2^-24 <= scale <= 2^32, at most 32 consecutive retries.
"""
from dataclasses import dataclass, replace

from ..errors import DataError

INITIAL = 65536.0
GROWTH_INTERVAL = 2000
MAX_SCALE = 2.0 ** 32
MIN_SCALE = 2.0 ** -24
MAX_RETRIES = 32


@dataclass(frozen=True)
class LossScale:
    scale: float = INITIAL
    good_updates: int = 0     # successful updates since the scale last changed
    overflows: int = 0        # total overflowed windows in this run
    retries: int = 0          # consecutive overflows of the current window

    def overflowed(self, update: int) -> "LossScale":
        nxt = replace(self, scale=self.scale / 2, good_updates=0, overflows=self.overflows + 1,
                      retries=self.retries + 1)
        if nxt.retries > MAX_RETRIES or nxt.scale < MIN_SCALE:
            raise DataError(f"FP16 gradients overflowed {nxt.retries} times in a row at update {update} "
                            f"(loss scale {self.scale:g}); the model or rate does not fit float16: "
                            "lower the rate or use precision='bfloat16' or 'float32'")
        return nxt

    def succeeded(self) -> "LossScale":
        good = self.good_updates + 1
        if good >= GROWTH_INTERVAL:
            return replace(self, scale=min(self.scale * 2, MAX_SCALE), good_updates=0, retries=0)
        return replace(self, good_updates=good, retries=0)

    def as_dict(self) -> dict:
        return {"scale": self.scale, "good_updates": self.good_updates, "overflows": self.overflows,
                "retries": self.retries}
