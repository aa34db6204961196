"""A round table's own consistency check, shared by the CPU engine's probe (`serve.engines.cpu.probe`) and the
pipeline's engine-agnostic shape probe (`pipeline.measure.shape`). Torch-free and pure."""

from __future__ import annotations

from typing import Any

__all__ = ["MONOTONE_SLACK", "MONOTONE_SLACK_MS", "REPRODUCE_TOLERANCE", "first_dip", "reproduces"]

MONOTONE_SLACK = 0.85  # a cell below this share of a narrower or smaller one (and by more than MONOTONE_SLACK_MS)
MONOTONE_SLACK_MS = 1.0  # is not the noise of a quiet machine
REPRODUCE_TOLERANCE = 0.15  # two clean tables whose cells agree this closely, dip included, show the engine's shape


def first_dip(table: dict[str, Any]) -> str | None:
    """The first cell of a round table (`ms[batch][width]`, with its `widths` and `batches`) clearly below a
    narrower or smaller one, in words; None when there is none."""
    ms, widths, batches = table.get("ms") or [], table.get("widths") or [], table.get("batches") or []
    for i, row in enumerate(ms):
        for j in range(1, len(row)):
            if row[j] < MONOTONE_SLACK * max(row[:j]) and max(row[:j]) - row[j] > MONOTONE_SLACK_MS:
                return (f"not monotone: {batches[i]} request(s) x width {widths[j]} measured {row[j]:.1f} ms, below "
                        f"a narrower width's {max(row[:j]):.1f} ms")
    for i in range(1, len(ms)):
        for j, cell in enumerate(ms[i]):
            smaller = max(row[j] for row in ms[:i])
            if cell < MONOTONE_SLACK * smaller and smaller - cell > MONOTONE_SLACK_MS:
                return (f"not monotone: {batches[i]} requests x width {widths[j]} measured {cell:.1f} ms, below a "
                        f"smaller batch's {smaller:.1f} ms")
    return None


def reproduces(first: dict[str, Any], second: dict[str, Any], tolerance: float = REPRODUCE_TOLERANCE) -> bool:
    """Whether two round tables have the same cells within `tolerance` (relative) and dip at the same cell: measured
    twice on a quiet machine, the dip is then the engine's own."""
    if (first.get("batches"), first.get("widths")) != (second.get("batches"), second.get("widths")) \
            or not first.get("ms") or [len(r) for r in first["ms"]] != [len(r) for r in second.get("ms") or []]:
        return False
    cells = [(x, y) for row_a, row_b in zip(first["ms"], second["ms"]) for x, y in zip(row_a, row_b)]
    if any(abs(x - y) > tolerance * max(x, y) for x, y in cells):
        return False
    dip_a, dip_b = first_dip(first), first_dip(second)
    return dip_a is not None and dip_b is not None and dip_a.split(" measured")[0] == dip_b.split(" measured")[0]
