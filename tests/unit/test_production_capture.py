"""Traffic capture records what production really answered, readable by the operators only (issue #31 item 8)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time

import pyarrow.parquet as pq
import pytest
from fastapi.responses import StreamingResponse

from serve.closed_loop.capture import Capture, CaptureSettings, merge_parts

CHAT = [{"role": "user", "content": "Name a colour."}]


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _rows(directory) -> list[dict]:
    return [row for part in sorted(directory.glob("part-*.parquet")) for row in pq.read_table(part).to_pylist()]


def test_the_capture_folder_and_its_files_are_private_whatever_the_umask(tmp_path):
    previous = os.umask(0o022)  # a usual default: 0755 folders, 0644 files
    try:
        folder = tmp_path / "capture"
        cap = Capture(CaptureSettings(dir=str(folder), sample_rate=1, flush_rows=1))
        cap.record("/v1/completions", {"prompt": "my card number is 4111", "max_tokens": 4}, "!")
        cap.flush()
        merged = tmp_path / "captured.parquet"
        merge_parts(folder, merged)
    finally:
        os.umask(previous)
    parts = list(folder.glob("part-*.parquet"))
    assert parts and _mode(folder) == 0o700
    assert {_mode(p) for p in parts} == {0o600} and _mode(merged) == 0o600
    assert not list(folder.glob(".*"))  # no temporary file left


def test_a_stream_ended_by_an_error_event_is_not_captured(tmp_path):
    cap = Capture(CaptureSettings(dir=str(tmp_path), sample_rate=1, flush_rows=1, seed=0))

    async def cut_by_timeout():
        # what the ingress sends when request_timeout_s cuts a stream (serve/production/stream_relay.py): an error, then [DONE]
        yield f"data: {json.dumps({'choices': [{'delta': {'content': 'Bl'}}]})}\n\n".encode()
        yield b'data: {"error": {"message": "the request took longer than request_timeout_s=2", "code": 504}}\n\n'
        yield b"data: [DONE]\n\n"

    async def whole():
        yield f"data: {json.dumps({'choices': [{'delta': {'content': 'Blue.'}}]})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def drain(response):
        return [chunk async for chunk in response.body_iterator]

    for source in (cut_by_timeout, whole):
        response = asyncio.run(cap.observe("/v1/chat/completions", {"messages": CHAT, "stream": True, "max_tokens": 8},
                                           StreamingResponse(source(), status_code=200)))
        asyncio.run(drain(response))
    cap.flush()
    assert [row["output"] for row in _rows(tmp_path)] == ["Blue."]


def test_rows_carry_the_max_tokens_served_and_the_route_they_came_from(tmp_path):
    cap = Capture(CaptureSettings(dir=str(tmp_path), sample_rate=1, flush_rows=1), default_max_tokens=2048)
    cap.record("/v1/completions", {"prompt": "Once"}, " upon")  # no max_tokens: the engine was asked for 16
    cap.record("/v1/chat/completions", {"messages": CHAT}, "Blue.")  # chat: the endpoint's limit
    cap.flush()
    rows = _rows(tmp_path)
    assert [(row["id"].split(":")[0], row["max_new_tokens"]) for row in rows] == [("completions", 16),
                                                                                  ("chat", 2048)]


def test_a_link_planted_in_a_shared_folder_is_never_written_through(tmp_path):
    # issue 42 item 4: the temporary file had a predictable name and was opened without O_EXCL|O_NOFOLLOW, so a link
    # planted under that name made the capture overwrite its target with captured prompts
    folder = tmp_path / "capture"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (folder / f".part-x-000001.parquet.{os.getpid()}.tmp").symlink_to(victim)  # the name the old scheme picked
    cap = Capture(CaptureSettings(dir=str(folder), sample_rate=1, flush_rows=1))
    cap._tag = "x"  # the part names the planted links were made for
    cap.record("/v1/completions", {"prompt": "my card number is 4111", "max_tokens": 4}, "!")
    cap.flush()
    assert victim.read_text() == "precious"
    assert [row["prompt"] for row in _rows(folder)] == ["my card number is 4111"]


def test_write_private_refuses_an_existing_name_and_replaces_a_planted_link_itself(tmp_path, monkeypatch):
    import secrets

    from serve.closed_loop.capture import write_private

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    monkeypatch.setattr(secrets, "token_hex", lambda n: "guessed")  # an attacker who guessed the random part too
    (tmp_path / ".out.parquet.guessed.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_private(lambda handle: handle.write(b"captured"), tmp_path / "out.parquet")
    assert victim.read_text() == "precious"
    monkeypatch.undo()
    (tmp_path / "out.parquet").symlink_to(victim)  # a link at the final name: the rename replaces the link
    write_private(lambda handle: handle.write(b"captured"), tmp_path / "out.parquet")
    assert victim.read_text() == "precious" and not (tmp_path / "out.parquet").is_symlink()


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o701])
def test_an_existing_capture_folder_open_to_others_is_refused_naming_the_fix(tmp_path, mode):
    # issue 42 item 4: it was kept with a warning
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, mode)
    with pytest.raises(ValueError, match=rf"is open to other users \(mode {mode:o}\).*chmod 700"):
        Capture(CaptureSettings(dir=str(folder)))
    os.chmod(folder, 0o700)
    Capture(CaptureSettings(dir=str(folder))).close()


def test_a_buffered_row_is_written_once_it_is_flush_s_old_without_another_request(tmp_path):
    # issue 42 item 5: flush_s was only checked when a row arrived; the last rows before a quiet spell stayed in memory
    cap = Capture(CaptureSettings(dir=str(tmp_path), sample_rate=1, flush_rows=64, flush_s=3600))
    cap.record("/v1/completions", {"prompt": "Once", "max_tokens": 2}, " upon")
    answered = cap._oldest
    assert not cap.flush_due(now=answered + 3599) and _rows(tmp_path) == []
    assert cap.flush_due(now=answered + 3600)
    cap.flush()  # waits for the write handed over above
    assert [row["output"] for row in _rows(tmp_path)] == [" upon"]


def test_the_timer_writes_a_quiet_buffer_by_itself(tmp_path):
    cap = Capture(CaptureSettings(dir=str(tmp_path), sample_rate=1, flush_rows=64, flush_s=0.2))
    cap.record("/v1/completions", {"prompt": "Once", "max_tokens": 2}, " upon")
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("part-*.parquet")) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition under a deadline: no other request comes
    assert [row["output"] for row in _rows(tmp_path)] == [" upon"]


def test_close_writes_the_buffer_and_takes_no_more_rows(tmp_path):
    cap = Capture(CaptureSettings(dir=str(tmp_path), sample_rate=1, flush_rows=64, flush_s=3600))
    for word in ("a", "b"):
        cap.record("/v1/completions", {"prompt": word, "max_tokens": 2}, "!")
    cap.close()
    cap.close()
    cap.record("/v1/completions", {"prompt": "late", "max_tokens": 2}, "!")
    assert [row["prompt"] for row in _rows(tmp_path)] == ["a", "b"]


def test_rows_whose_write_failed_do_not_count_toward_max_rows(tmp_path, monkeypatch):
    # issue 42 item 10: rows lost to a full disk counted toward max_rows, so the capture stopped short of it
    import serve.closed_loop.capture as capture

    real = capture.write_private
    full = [True]

    def disk(write, path):
        if full[0]:
            raise OSError(28, "No space left on device")  # ENOSPC: a real disk cannot be filled here
        real(write, path)

    monkeypatch.setattr(capture, "write_private", disk)
    cap = Capture(CaptureSettings(dir=str(tmp_path), sample_rate=1, flush_rows=1, max_rows=2))
    cap.record("/v1/completions", {"prompt": "lost", "max_tokens": 2}, "!")
    cap.flush()
    full[0] = False
    for word in ("kept-1", "kept-2", "over"):
        cap.record("/v1/completions", {"prompt": word, "max_tokens": 2}, "!")
    cap.flush()
    assert [row["prompt"] for row in _rows(tmp_path)] == ["kept-1", "kept-2"]


def test_fifos_and_links_named_like_parts_are_skipped_never_opened(tmp_path):
    # issue 42 item 11: a FIFO named like a part hung the capture's start (its row count opened it)
    folder = tmp_path / "capture"
    first = Capture(CaptureSettings(dir=str(folder), sample_rate=1, flush_rows=1))
    first.record("/v1/completions", {"prompt": "real", "max_tokens": 2}, "!")
    first.close()
    os.mkfifo(folder / "part-fifo-000001.parquet")
    (folder / "part-link-000001.parquet").symlink_to(next(folder.glob("part-*.parquet")))
    again = Capture(CaptureSettings(dir=str(folder), sample_rate=1, flush_rows=1, max_rows=2))  # returns: no hang
    assert again._kept == 1  # the real part only
    merged = tmp_path / "merged.parquet"
    assert merge_parts(folder, merged) == 1

    from pipeline.loop.split import read_capture

    assert [row["prompt"] for row in read_capture(folder)] == ["real"]


def test_the_endpoint_refuses_a_shared_capture_folder_before_ray_starts(tmp_path, capsys):
    # exit 2 with the fix in the terminal at once, instead of an ingress that fails to construct three times
    from serve.production.cli import main

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert main(["--config-file", str(tmp_path / "serving.json"), "--capture", str(shared)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("error: --capture: the capture directory") and "is open to other users (mode 777)" in out
    assert f"chmod 700 {shared}" in out
