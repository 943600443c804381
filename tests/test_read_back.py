"""read_back: the one bounded read of the files dptrain reads back, and the checks of the values taken from them."""

from __future__ import annotations

import json
import math
import os
import threading

import pytest

from dptrain import read_back
from dptrain.read_back import BadValue, UnreadableFile


def test_a_regular_file_is_read_and_a_missing_one_is_left_to_the_caller(tmp_path):
    (tmp_path / "a.json").write_text('{"x": 1}')
    assert read_back.read_json(tmp_path / "a.json", lambda v: read_back.mapping(v, "the file")) == {"x": 1}
    with pytest.raises(FileNotFoundError):
        read_back.read_bytes(tmp_path / "missing.json")


@pytest.mark.parametrize("planted", ["link to /dev/zero", "fifo", "folder", "too large"])
def test_what_is_no_regular_file_of_its_size_is_refused_in_one_sentence_without_reading_it(tmp_path, planted):
    path = tmp_path / "peak.json"
    if planted == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif planted == "fifo":
        os.mkfifo(path)  # no writer: a plain open() would wait for one forever
    elif planted == "folder":
        path.mkdir()
    else:
        path.write_bytes(b" " * (read_back.SMALL_BYTES + 1))
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            read_back.read_bytes(path)
        except BaseException as exc:  # noqa: BLE001 - the test inspects whatever came out
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=30)  # a read that blocks or runs on never returns: the bound says so
    assert not reader.is_alive(), "the read did not return"
    [error] = outcome
    assert isinstance(error, UnreadableFile) and str(error).count(";") == 1 and "\n" not in str(error)
    says = {"link to /dev/zero": "is a character device, not a regular file", "fifo": "is a FIFO, not a regular file",
            "folder": "is a folder, not a file",
            "too large": "is larger than 1 MiB, far more than dptrain writes there"}[planted]
    assert str(error).startswith(f"{path} {says}; delete it, or give another folder")


def test_a_head_is_cut_at_its_bound_and_bad_bytes_replaced(tmp_path):
    path = tmp_path / "job.err"
    path.write_bytes(b"error \xff here" + b"x" * 5000)
    assert read_back.read_head(path, 12) == "error \ufffd here"


@pytest.mark.parametrize("text, says", [
    ("[" * 50_000, "is not JSON"),
    ('{"n": ' + "9" * 5000 + "}", "is not JSON"),
    ("\xff", "is not JSON"),
])
def test_json_that_python_cannot_take_is_one_sentence(tmp_path, text, says):
    path = tmp_path / "sweep.json"
    path.write_text(text)
    with pytest.raises(UnreadableFile, match=f"^{path} {says}"):
        read_back.read_json(path, lambda v: v)


def test_a_value_refused_names_its_place_in_the_file(tmp_path):
    path = tmp_path / "link.json"
    path.write_text(json.dumps({"probes": [{"seconds": 1e308}]}))

    def take(value):
        probe = read_back.sequence(read_back.field(value, "probes", "the file"), "probes")[0]
        return read_back.number(probe["seconds"], "probes[0].seconds", 1e-9, 3600)

    with pytest.raises(UnreadableFile) as refused:
        read_back.read_json(path, take, advice="run the sweep again")
    assert str(refused.value) == (f"{path} is not what dptrain writes there (probes[0].seconds = 1e+308, not a number "
                                  f"from 1e-09 to 3600); run the sweep again.")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -math.inf, 1e308, -1.0, True, "1", None, [1]])
def test_a_number_out_of_its_range_or_of_another_type_is_refused(value):
    with pytest.raises(BadValue, match=r"^x = .*, not a number from 0 to 1e\+06$"):
        read_back.number(value, "x", 0, 1e6)


def test_numbers_in_range_are_taken_and_the_low_end_only_where_allowed():
    assert read_back.number(0, "x", 0, 1) == 0.0 and isinstance(read_back.number(1, "x", 0, 1), float)
    with pytest.raises(BadValue, match="above 0 and at most 1"):
        read_back.number(0.0, "x", 0, 1, above_low=True)
    assert read_back.integer("256", "size", 1, 1024) == 256 and read_back.integer(2.0, "n", 1, 4) == 2
    for bad in ("2.5", "-1", "²", 2.5, True, 5, "9" * 30):
        with pytest.raises(BadValue):
            read_back.integer(bad, "n", 1, 4)


def test_json_lines_skip_and_name_the_lines_they_cannot_use(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "a"}\n[1]\nnot json\n' + "[" * 100_000 + "\n" + '{"event": "b", "n": -1}\n'
                    + '{"event": "c"}\n{"event": "cut sh')
    events, skipped = read_back.read_json_lines(path, lambda e: "n is negative" if e.get("n", 0) < 0 else None)
    assert [e["event"] for e in events] == ["a", "c"]
    # the last line, cut short as a killed writer leaves it, is skipped without a word
    assert skipped == ["line 2: it is JSON but not an object", "line 3: it is not JSON",
                       "line 4: it nests brackets too deep to be an event", "line 5: n is negative"]
    assert read_back.read_json_lines(tmp_path / "none.jsonl") == ([], [])
