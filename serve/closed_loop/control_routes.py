"""What the production endpoint's closed-loop control routes serve (`serve.closed_loop.control`), apart from HTTP: posted
bodies checked against the contract, the latest drift report and its gauges (`POST /v1/drift`), and the capture's
parts (`GET /v1/capture`, `GET /v1/capture/<name>`). The ingress (`serve/production/ingress.py`) checks the admin key before it calls these.

Capture parts are served by name only: a name must match `PART_NAME` (`part-<tag>-<seq>.parquet`, no path
separator, no dot-file: the temporary files a write leaves for an instant are never listed), and the file must be a
regular file directly in the capture directory, not a link. Files are read on a worker thread, never on the event
loop.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Gauge
from pydantic import BaseModel, ValidationError

from serve.closed_loop.control import PART_NAME, CaptureListing, CapturePart, DriftReport
from serve.closed_loop.capture import CaptureSettings
from serve.closed_loop.files import open_regular, read_regular
from serve.http_errors import RequestRejected, short

__all__ = ["DriftBoard", "contract_body", "capture_listing", "capture_part", "PARQUET_MEDIA_TYPE"]

PARQUET_MEDIA_TYPE = "application/vnd.apache.parquet"
ModelT = TypeVar("ModelT", bound=BaseModel)


def contract_body(kind: type[ModelT], data: Any) -> ModelT:
    """A posted JSON body as the contract's `kind`; anything else is a 422 naming the field."""
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"])) or "(body)"
        raise RequestRejected(422, f"{kind.__name__}: {where}: {first['msg']} (got {short(first.get('input'))}); "
                                   f"send a serve.closed_loop.control.{kind.__name__}") from None


class DriftBoard:
    """The latest drift report, and its lines as gauges (`specdec_drift_statistic`, `specdec_drift_alarm`, labels
    `metric`, `bucket`). A new report replaces the old one whole, so a line the loop no longer reports does not
    linger, and the labels stay those of one report."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.latest: DriftReport | None = None
        self.statistic = Gauge("specdec_drift_statistic", "the drift test's statistic (CUSUM log-likelihood "
                               "ratio; alarm at its threshold), as the loop last posted it", ["metric", "bucket"],
                               registry=registry)
        self.alarm = Gauge("specdec_drift_alarm", "1 while the loop's drift test is in alarm", ["metric", "bucket"],
                           registry=registry)

    def post(self, report: DriftReport) -> None:
        self.statistic.clear()
        self.alarm.clear()
        for line in report.lines:
            self.statistic.labels(line.metric, str(line.bucket)).set(line.statistic)
            self.alarm.labels(line.metric, str(line.bucket)).set(1.0 if line.alarm else 0.0)
        self.latest = report

    def shown(self) -> dict[str, Any] | None:
        return None if self.latest is None else self.latest.model_dump(mode="json")


def _capture_on(settings: CaptureSettings | None) -> CaptureSettings:
    if settings is None:
        raise RequestRejected(409, "traffic capture is off on this endpoint; start it with --capture DIR "
                                   "(ProductionSettings.capture; read docs/security.md first)")
    return settings


def _regular(path: Path) -> os.stat_result | None:
    try:
        info = path.lstat()
    except OSError:
        return None
    return info if stat.S_ISREG(info.st_mode) else None


def _listing(directory: Path, max_rows: int) -> CaptureListing:
    import pyarrow.parquet as pq

    parts = []
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        info = _regular(path)
        if not PART_NAME.match(path.name) or info is None:
            continue
        try:  # opened as a regular file without following a link or blocking: a FIFO swapped in is refused
            with os.fdopen(open_regular(path, follow_links=False), "rb") as handle:
                rows = pq.ParquetFile(handle).metadata.num_rows
        except Exception:  # noqa: BLE001 - a damaged part is left out, as the capture's own count does
            continue
        parts.append(CapturePart(name=path.name, rows=rows, bytes=info.st_size, mtime_ms=int(info.st_mtime * 1000)))
    return CaptureListing(parts=tuple(parts), max_rows=max_rows)


async def capture_listing(settings: CaptureSettings | None) -> CaptureListing:
    on = _capture_on(settings)
    return await asyncio.to_thread(_listing, Path(on.dir), on.max_rows)


def _read(path: Path) -> bytes:
    # a link or a FIFO swapped in after the check is refused (O_NOFOLLOW, O_NONBLOCK), not followed or waited on
    return read_regular(path, follow_links=False)


async def capture_part(settings: CaptureSettings | None, name: str) -> bytes:
    """One part's bytes, by a name `PART_NAME` accepts (400 otherwise); 404 when no such part exists."""
    directory = Path(_capture_on(settings).dir)
    if not PART_NAME.match(name):
        raise RequestRejected(400, f"capture part name {short(name)} is not a part file name "
                                   "(part-<tag>-<seq>.parquet, as GET /v1/capture lists them)")
    path = directory / name
    if _regular(path) is None:
        raise RequestRejected(404, f"no capture part {name!r} (GET /v1/capture lists the parts)", "not_found_error")
    try:
        return await asyncio.to_thread(_read, path)
    except OSError:
        raise RequestRejected(404, f"capture part {name!r} cannot be read", "not_found_error") from None
