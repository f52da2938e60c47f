"""A rank's output on its way to the driver: never cut, never dropped without a word.

A line over the channel's frame limit (1 MiB), or a progress bar redrawn with
\\r and never ended, used to end the rank's channel: later lines, the failure
record and the end marker were lost.  Output faster than the channel used to
be dropped silently; now the rank is held back, or the driver is told how many
lines it lost.
"""
from __future__ import annotations

import io
import re

import pytest

import _default_ranks as ranks
import _fault_kit as kit
from horovod_spark._job.logchannel import MAX_LINE, split_lines


def test_split_lines_cuts_at_newlines_carriage_returns_and_the_length_limit():
    data = b"a\nb\r\nc\rd" + b"y" * 10 + b"\n" + b"z" * 25
    got = list(split_lines(io.BufferedReader(io.BytesIO(data)), limit=8))
    assert got == [b"a", b"b", b"c", b"dyyyyyyy", b"yyy", b"zzzzzzzz", b"zzzzzzzz",
                   b"zzzzzzzz", b"z"], got


def test_split_lines_keeps_a_crlf_that_straddles_two_reads():
    class Chunks(io.RawIOBase):
        def __init__(self, parts):
            self.parts = list(parts)

        def readable(self):
            return True

        def readinto(self, b):
            if not self.parts:
                return 0
            part = self.parts.pop(0)
            b[:len(part)] = part
            return len(part)

    pipe = io.BufferedReader(Chunks([b"one\r", b"\ntwo\r", b"three"]), buffer_size=4)
    assert list(split_lines(pipe)) == [b"one", b"two", b"three"]


@pytest.mark.spark
@pytest.mark.slow
def test_a_line_over_a_mebibyte_and_a_progress_bar_do_not_cut_the_ranks_output(spark, fault):
    out = kit.run_spark_job(ranks.long_lines, 2, env=fault.env(), outdir=fault.outdir)
    assert out.error is None and out.value == [0, 1], out.error
    for r in (0, 1):
        assert f"[{r}]<stdout>:rank {r}: after the long lines" in out.output, out.output[-2000:]
        pieces = [ln for ln in out.output.splitlines() if ln.startswith(f"[{r}]<stdout>:xxxx")]
        assert sum(len(p) - len(f"[{r}]<stdout>:") for p in pieces) == 2 << 20
        assert max(len(p) for p in pieces) <= MAX_LINE + 20
        assert f"[{r}]<stdout>:progress 1999/2000 " in out.output


@pytest.mark.spark
@pytest.mark.slow
def test_every_line_of_a_fast_writer_reaches_the_driver_or_the_loss_is_reported(spark, fault):
    n = 300_000
    out = kit.run_spark_job(ranks.many_lines, 2, args=(n,), env=fault.env(), outdir=fault.outdir)
    assert out.error is None, out.error
    for r in (0, 1):
        got = len(re.findall(rf"^\[{r}\]<stdout>:r{r} line \d+$", out.output, re.M))
        dropped = re.search(rf"rank {r}: (\d+) lines of output dropped", out.output)
        assert got + (int(dropped.group(1)) if dropped else 0) == n, (r, got, dropped)
        assert got == n, f"rank {r}: {n - got} of {n} lines dropped with back-pressure on"


def test_the_log_server_skips_an_oversized_frame_and_keeps_the_connection():
    import socket
    import struct

    from collectives.rendezvous import auth
    from horovod_spark._job.logchannel import MAX_FRAME, LineSink, LogServer, send_frame

    secret, shown = auth.new_secret(), io.StringIO()
    server = LogServer("127.0.0.1", secret, "job", LineSink(shown, shown))
    try:
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            ch = auth.client_handshake(s, secret, "log", timeout=5)
            send_frame(s, {"t": "hello", "job": "job", "rank": 1}, ch)
            head, big = struct.pack(">I", 2 * MAX_FRAME), b" " * (2 * MAX_FRAME)
            s.sendall(head + big + ch.seal(head, big))
            send_frame(s, {"t": "out", "s": "stdout", "x": "after the big frame"}, ch)
            send_frame(s, {"t": "done"}, ch)
            assert server.wait_done([1], timeout=30), "the server hung up after the big frame"
        assert "[1]<stdout>:after the big frame" in shown.getvalue()
    finally:
        server.close()
