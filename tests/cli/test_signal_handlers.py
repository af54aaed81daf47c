"""The signal handlers of the process are as they were after ``stop_on_signals`` and ``aqsgd.cli.main``,
however they end: a handler left behind outlives the command (in a test suite, every later test)."""

from __future__ import annotations

import signal

import pytest

from aqsgd import interrupts
from aqsgd.cli import main
from aqsgd.errors import Interrupted
from aqsgd.interrupts import STOP_SIGNALS, stop_on_signals


def _handlers() -> dict[int, object]:
    return {s: signal.getsignal(s) for s in STOP_SIGNALS}


def test_handlers_come_back_after_the_block_and_after_an_error():
    before = _handlers()
    with stop_on_signals():
        assert all(h is not before[s] for s, h in _handlers().items())
    assert _handlers() == before
    with pytest.raises(ValueError), stop_on_signals(again="ignore"):
        raise ValueError("boom")
    assert _handlers() == before


def test_handlers_come_back_when_installing_them_fails_part_way(monkeypatch):
    before = _handlers()
    real = signal.signal

    def refuse_the_second(signum, handler):
        if signum == STOP_SIGNALS[1] and handler not in before.values():
            raise OSError("cannot install")
        return real(signum, handler)

    monkeypatch.setattr(interrupts.signal, "signal", refuse_the_second)
    with pytest.raises(OSError, match="cannot install"), stop_on_signals():
        pass
    monkeypatch.undo()
    assert _handlers() == before


def test_main_leaves_the_handlers_as_it_found_them(capsys, monkeypatch):
    before = _handlers()
    assert main(["codecs", "q4"]) == 0
    assert _handlers() == before

    def interrupted(args):
        raise Interrupted(signal.SIGTERM)

    from aqsgd.cli import codecs

    monkeypatch.setattr(codecs, "run", interrupted)
    assert main(["codecs", "q4"]) == 128 + signal.SIGTERM
    assert _handlers() == before
    capsys.readouterr()
