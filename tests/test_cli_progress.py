"""``ortpa convert``'s progress: a bar on a terminal, plain lines otherwise, nothing with --quiet."""

from __future__ import annotations

import io
from pathlib import Path

from ortpa.cli import main
from ortpa.cli.progress import ConvertProgress
from ortpa.progress import BytesWritten, LayerStarted, Stage, StageStarted

FIXTURE = Path(__file__).parent / "fixtures" / "dsv3_sdpa_op18.onnx"


def test_terminal_bar_shows_layers_then_bytes():
    """On a terminal the line is redrawn in place: layers done of the total, then bytes written of the total."""
    stream = io.StringIO()
    p = ConvertProgress(stream, tty=True)
    p(StageStarted(Stage.LOAD, "loading"))
    for i in range(3):
        p(LayerStarted(i, 4, 10 + i, f"any words {i}"))  # counted by type, whatever the text says
    shown = str(p._bar)  # the line as tqdm renders it now (it throttles what it writes to the stream)
    assert "3/4" in shown and "any words 2" in shown
    p(BytesWritten(0, 4_000_000_000))
    p(BytesWritten(1_000_000_000, 4_000_000_000))
    assert "1.00G/4.00G" in str(p._bar)
    out = stream.getvalue()
    assert "\r" in out and "written" not in out  # redrawn, never the plain lines
    p(StageStarted(Stage.DONE, "moving it into place"))
    assert p._bar is None  # closed: the terminal gets its line back


def test_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    p = ConvertProgress(stream, tty=False)
    p(StageStarted(Stage.LOAD, "loading"))
    for done in range(0, 101, 5):
        p(BytesWritten(done, 100))
    lines = stream.getvalue().splitlines()
    assert lines[0] == "  loading"
    assert sum("written" in line for line in lines) == 11  # 0 %, 10 %, ..., 100 %
    assert "\r" not in stream.getvalue()


def test_cli_convert_progress_and_quiet(tmp_path, capsys):
    assert main(["convert", str(FIXTURE), str(tmp_path / "a.onnx")]) == 0
    err = capsys.readouterr().err
    assert "absorbing layer 0" in err and "checking" in err  # stderr is not a terminal under pytest
    assert main(["convert", str(FIXTURE), str(tmp_path / "b.onnx"), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_convert_file_feeds_the_bar_layers_and_bytes(tmp_path, monkeypatch):
    """The converter tells the display how many layers there are and how many bytes are written."""
    import ortpa.rewriter.model_store as model_store
    from ortpa.conversion import convert_file

    monkeypatch.setattr(model_store, "EXTERNAL_DATA_THRESHOLD", 1)  # external data: bytes are reported
    stream = io.StringIO()
    p = ConvertProgress(stream, tty=True)
    convert_file(FIXTURE, tmp_path / "paged.onnx", progress=p)
    assert p.total_layers == 2 and p.layer == 2
    data = (tmp_path / "paged.onnx.data").stat().st_size
    assert p.total_bytes >= data and p.done_bytes == p.total_bytes
    assert "/2 [" in stream.getvalue() and "B/s" in stream.getvalue()  # a layer bar of 2, then bytes


def test_plain_lines_rate_counts_from_the_first_report(monkeypatch):
    """The rate shown is what was written since the count's first report over the time since then: a first tensor
    written before any report does not count as written in no time."""
    import ortpa.cli.progress as progress

    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    stream = io.StringIO()
    p = ConvertProgress(stream, tty=False)
    p(BytesWritten(600_000_000, 1_000_000_000))  # the count starts here (100 s): 600 MB already written
    now[0] = 101.0
    p(BytesWritten(700_000_000, 1_000_000_000))  # 100 MB in one second
    now[0] = 102.0
    p(BytesWritten(800_000_000, 1_000_000_000))  # 200 MB in two
    lines = [line for line in stream.getvalue().splitlines() if "written" in line]
    assert "MB/s" not in lines[0]
    assert "100 MB/s, ETA 0:03" in lines[1] and "100 MB/s, ETA 0:02" in lines[2]
