"""Progress bars in a log file."""

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
