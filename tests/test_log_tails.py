"""Log tails read whole lines: a carriage return (a progress bar's redraw) never splits one
(issue 17 item 5). shutdown's `_LogTail` and doctor's `last-run` tail both split at newlines
only, through `parse.vllmlog.log_lines`."""

from __future__ import annotations

from xpuctl.output.safetext import safe
from xpuctl.shutdown.logtail import LogTail
from xpuctl.state.lastrun import log_tail

BAR = "Processed prompts:  50%|#####     | 1/2\rProcessed prompts: 100%|##########| 2/2"


def test_shutdown_tail_keeps_a_cr_line_whole_and_shows_it_escaped(tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(b"before\n")
    tail = LogTail(str(log))  # starts at the end: only what is appended counts
    with log.open("ab") as fh:
        fh.write(f"(APIServer pid=7) INFO 12-01 10:00:00 [api.py:1] {BAR}\n".encode())
        fh.write(b"(APIServer pid=7) INFO 12-01 10:00:01 [launcher.py:9] [shutdown] draining"
                 b"\rsending SIGTERM\r\n")
        fh.write(b"xpuctl: our own line [shutdown]\n")
        fh.write(b"[shutdown] partial, no newline yet")
    phases = tail.new_phases()
    assert phases == ["[shutdown] draining\rsending SIGTERM"]  # one line, CR inside
    assert safe(phases[0]) == "[shutdown] draining\\rsending SIGTERM"  # one line on screen
    with log.open("ab") as fh:
        fh.write(b"\n")
    assert tail.new_phases() == ["[shutdown] partial, no newline yet"]


def test_last_run_tail_keeps_a_cr_line_whole(tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(f"{BAR}\nsecond\x0bline\x85x\nxpuctl: mine\n".encode())  # NEL: c2 85
    assert log_tail(str(log)) == [BAR, "second\x0bline\x85x"]
