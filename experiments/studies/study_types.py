"""A study's variants and the study itself (experiments/studies/presets.py builds them; the
stability presets in experiments/studies/stability_presets.py too)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from experiments import sweeps


@dataclasses.dataclass(frozen=True)
class Variant:
    """One line of a study: `id` (CSV key), `label` (legend), the cell's settings, and for
    plots against a parameter `series` (one line per series) and `param` (its x value)."""
    id: str
    label: str
    method: str
    shape: str
    staleness: int = 4
    mode: str = "limit"           # limit: max_staleness only; forced: exactly k stale
    extra: Tuple[Tuple[str, object], ...] = ()
    tag: str = ""                 # folder-name stand-in for `extra` (sweeps.Cell.tag)
    series: str = ""
    param: Optional[float] = None
    seeds: Optional[Tuple[int, ...]] = None   # fewer seeds than its study's (None: the study's)

    def cell(self, seed: int) -> sweeps.Cell:
        return sweeps.Cell(self.method, self.shape, self.staleness, seed, self.mode,
                           self.extra, self.tag)


@dataclasses.dataclass(frozen=True)
class Study:
    name: str
    title: str
    kind: str     # curves | staleness | ablation | pretrain | shift | stability | calibration
    variants: Tuple[Variant, ...]
    base: Tuple[Tuple[str, object], ...]
    seeds: Tuple[int, ...] = (0, 1, 2)
    comparisons: Tuple[Tuple[str, str], ...] = ()   # (variant id a, variant id b): a - b
    param_name: str = ""

    def variant(self, vid: str) -> Variant:
        return next(v for v in self.variants if v.id == vid)
