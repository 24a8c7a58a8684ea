"""A live progress bar (tqdm) that trainers advance once per update; a no-op when disabled."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, initial: int = 0, enabled: bool = True, unit: str = "step"):
        self._bar = tqdm(total=total, initial=initial, unit=unit, unit_scale=True, dynamic_ncols=True,
                         file=sys.stderr, smoothing=0.1) if enabled else None

    def advance(self, n: int, **postfix) -> None:
        if self._bar is None:
            return
        shown = {k: (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}") for k, v in postfix.items() if v is not None}
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
