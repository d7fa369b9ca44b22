"""Progress bars in a log file."""

import os
import select
import sys

from metatrain import progress


def test_the_bar_in_a_log_file_writes_lines(capsys):
    """Where stderr is not a terminal (a log file, a scheduler's output), each update is a line of its own: tqdm's
    updates start with a carriage return, so a whole run's progress was one line in the log."""
    with progress.bar(3, "meta-train") as bar:
        for _ in range(3):
            bar.update()
    with progress.bar(2048, "scoring", unit="B", unit_scale=True) as bar:
        bar.update(2048)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert lines[0].startswith("meta-train:   0%") and lines[1].startswith("meta-train: 100%"), lines
    assert lines[2].startswith("scoring:   0%") and lines[-1].startswith("scoring: 100%"), lines
    assert "2.05k/2.05k" in lines[-1] and len(lines) == 4, lines
    assert all(line == line.rstrip() for line in lines), lines


def test_over_shows_nothing_and_lines_a_line_per_item_in_a_log_file(capsys):
    assert list(progress.over(range(3), desc="documents")) == [0, 1, 2]
    assert capsys.readouterr().err == ""
    assert list(progress.lines(iter("ab"), desc="compiling")) == ["a", "b"]
    assert capsys.readouterr().err == "compiling 1/2 ...\ncompiling 2/2 ...\n"


def test_on_a_terminal_of_no_size_the_bar_still_shows(monkeypatch):
    """A terminal whose size reads 0 x 0 (a pseudo-terminal nobody sized: `pty.fork`, some containers' exec): tqdm
    fitted the bar to 0 columns and printed nothing for a whole run."""
    master, slave = os.openpty()  # never sized: 0 rows, 0 columns
    stderr = open(slave, "w")  # noqa: SIM115
    monkeypatch.setattr(sys, "stderr", stderr)
    with progress.bar(3, "meta-train") as bar:
        for _ in range(3):
            bar.update()
    stderr.flush()
    shown = ""
    while select.select([master], [], [], 0.5)[0]:  # all it wrote
        shown += os.read(master, 65536).decode()
    stderr.close()
    os.close(master)
    assert "meta-train: 100%" in shown and "3/3" in shown, repr(shown)
