"""Loss scalers for fp16 training: a constant one and Megatron's dynamic one.

The scale is a Python float. fp16 already needs one host sync per step (to learn
whether the gradients overflowed), so keeping the scale on the host costs nothing
more, makes ``loss * scale`` a kernel argument instead of a device tensor, and keeps
the state dict plain numbers.

Dynamic rule (Megatron's): every overflow resets the growth counter and uses up one
unit of hysteresis; once hysteresis is used up, each further overflow halves the scale
(not below ``min_scale``). After ``growth_interval`` clean steps in a row the scale
doubles and hysteresis is refilled.
"""


class ConstantGradScaler:
    """A fixed loss scale (``--loss-scale``)."""

    def __init__(self, scale: float):
        if scale <= 0:
            raise ValueError(f"--loss-scale must be positive, got {scale}.")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """A constant scale ignores overflows (the step is still skipped)."""

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, float]) -> None:
        # The command line decides a static scale; nothing to restore.
        pass


class DynamicGradScaler:
    """Megatron's dynamic loss scale with hysteresis.

    Args:
        initial_scale: Starting scale (``--initial-loss-scale``).
        min_scale: Floor (``--min-loss-scale``).
        growth_interval: Clean steps before the scale grows (``--loss-scale-window``).
        hysteresis: Overflows tolerated before the scale shrinks (``--hysteresis``).
        growth_factor: Multiplier on growth.
        backoff_factor: Multiplier on shrink.
    """

    def __init__(
        self,
        *,
        initial_scale: float,
        min_scale: float,
        growth_interval: int,
        hysteresis: int,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        if initial_scale <= 0:
            raise ValueError(f"--initial-loss-scale must be positive, got {initial_scale}.")
        if min_scale <= 0 or min_scale > initial_scale:
            raise ValueError(f"--min-loss-scale must be in (0, --initial-loss-scale], got {min_scale}.")
        if growth_interval < 1:
            raise ValueError(f"--loss-scale-window must be >= 1, got {growth_interval}.")
        if hysteresis < 1:
            raise ValueError(f"--hysteresis must be >= 1, got {hysteresis}.")
        assert growth_factor > 1.0 and 0.0 < backoff_factor < 1.0
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Adjusts the scale after a step; ``found_inf`` says whether grads overflowed."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, float]:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
