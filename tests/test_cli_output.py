"""The files a command writes (--json, --trace): checked without touching anything, written whole, through
a link to the file it names, and in place where the path is a pipe or a device."""

from __future__ import annotations

import json
import os
import threading

import pytest

from refusion_mlx.cli import check_writable, write_text
from refusion_mlx.cli.trace import Trace


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


def test_the_check_changes_nothing_and_names_the_path(tmp_path):
    (tmp_path / "out.json.tmp").write_text("mine")  # a file of the user's that an old probe used to delete
    (tmp_path / "out.json").write_text("old")
    before = listing(tmp_path)
    check_writable(str(tmp_path / "out.json"))
    check_writable(str(tmp_path / "new.json"))
    assert listing(tmp_path) == before and (tmp_path / "out.json.tmp").read_text() == "mine"
    for path, error in ((tmp_path, IsADirectoryError), (tmp_path / "none" / "x.json", FileNotFoundError)):
        with pytest.raises(error) as e:
            check_writable(str(path))
        assert e.value.filename == str(path)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(PermissionError):
            check_writable(str(locked / "x.json"))


def test_a_file_is_replaced_whole_and_a_link_stays_a_link(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    real.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_text(str(link), '{"a": 1}\n')
    assert link.is_symlink() and json.loads(real.read_text()) == {"a": 1}
    assert real.stat().st_mode & 0o777 == 0o640  # its mode kept
    write_text(str(tmp_path / "new.json"), "[]")
    assert (tmp_path / "new.json").stat().st_mode & 0o777 == 0o666 & ~_umask()
    assert listing(tmp_path) == ["link.json", "new.json", "real.json"]  # no temporary left


def test_home_and_pipes(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    check_writable("~/r.json")
    write_text("~/r.json", "x")
    assert (tmp_path / "r.json").read_text() == "x"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    check_writable(str(fifo))
    write_text(str(fifo), "through the pipe")
    reader.join(10)
    assert got == ["through the pipe"] and fifo.is_fifo()


def test_a_trace_is_written_through_its_link(tmp_path):
    class Tok:
        eos_token_id = 1

        def decode(self, ids):
            return "x"

    target = tmp_path / "t.json"
    (tmp_path / "trace.json").symlink_to(target)
    trace = Trace(str(tmp_path / "trace.json"), Tok())
    trace.write()
    assert json.loads(target.read_text()) == [] and (tmp_path / "trace.json").is_symlink()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
