"""``LineTail``: the kill -9 suites' incremental reader of the clients' ack and event files."""

import json

from tests.daemon.json_lines import LineTail, read_lines


def test_line_tail_reads_what_read_lines_reads_as_the_file_grows(tmp_path):
    """A partial last line waits for its newline; appended lines come in order; earlier
    snapshots do not change (the soak compares acks before and after a kill)."""
    path = tmp_path / "acks-0"
    tail = LineTail(str(path))
    assert tail.read() == [] == read_lines(str(path))  # no file yet
    with open(path, "ab") as f:
        f.write(json.dumps({"n": 1}).encode() + b"\n" + b'{"n": ')
    first = tail.read()
    assert first == [{"n": 1}] == read_lines(str(path))
    with open(path, "ab") as f:
        f.write(b"2}\n" + json.dumps({"n": 3}).encode() + b"\n")
    assert tail.read() == [{"n": 1}, {"n": 2}, {"n": 3}] == read_lines(str(path))
    assert first == [{"n": 1}]
    assert tail.read() == read_lines(str(path))  # nothing new: same answer
