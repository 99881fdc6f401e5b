"""Megatron-LM's own timer unit tests, ported, run against Megatron-Core's ``Timers`` and ours.

Follows NVIDIA/Megatron-LM ``tests/unit_tests/test_timers.py`` at commit 9666d796 (on
refs/pull/5014; NVIDIA's main has no timers unit test). That version targets a fork's
``cur_platform.synchronize``; megatron-core 0.16.1 calls ``torch.cuda.synchronize()`` instead,
which conftest.py makes a no-op. Tests that patched private helpers upstream (the gather,
``logger.info``) run the public path here on a 1-rank gloo group. ``impl`` is ``megatron`` (the
reference: every test passes there) or ``ours``; the last tests pin behaviour of Megatron's
source that has no upstream test. Our clock is ``perf_counter_ns``, Megatron's ``time.time``;
the ``clock`` fixture feeds both the same readings.
"""

from __future__ import annotations

import logging

import pytest

from tests.dist_utils import free_port
from tests.peer.conftest import megatron_timers_on_cpu, recording_summary_writer


@pytest.fixture(scope="module")
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    yield
    dist.destroy_process_group()


@pytest.fixture(params=["megatron", "ours"])
def impl(request):
    if request.param == "ours":
        from distmetrics.collectors import timers

        yield timers
        return
    with megatron_timers_on_cpu() as timers:
        yield timers


@pytest.fixture
def clock(impl, monkeypatch):
    """Fixed clock readings in seconds, for either implementation's clock."""
    def install(seconds: list[float]):
        if impl.__name__.startswith("megatron"):
            readings = iter([0.0] + seconds)  # Megatron's Timer.__init__ reads time.time() once
            monkeypatch.setattr(impl.time, "time", lambda: next(readings))
        else:
            from distmetrics.collectors import timer  # where our Timer reads its clock

            readings = iter(int(round(v * 1e9)) for v in seconds)
            monkeypatch.setattr(timer.time, "perf_counter_ns", lambda: next(readings))
    return install


def test_dummy_timer_rejects_elapsed_queries(impl):
    timer = impl.DummyTimer()
    timer.start()
    timer.stop()
    timer.reset()
    with pytest.raises(Exception, match="dummy timer should not be used"):
        timer.elapsed()
    with pytest.raises(Exception, match="active timer should not be used"):
        timer.active_time()


def test_timer_lifecycle_accumulates_elapsed_and_active_time(impl, clock):
    clock([10.0, 10.25])
    timer = impl.Timer("forward")
    timer.start()
    timer.stop()
    assert timer.elapsed(reset=False) == pytest.approx(0.25)
    assert timer.active_time() == pytest.approx(0.25)
    assert not timer._started
    timer.reset()
    assert timer.elapsed(reset=False) == 0.0
    assert timer.active_time() == pytest.approx(0.25)


def test_timer_elapsed_restarts_running_timer(impl, clock):
    clock([1.0, 1.5, 2.0])
    timer = impl.Timer("backward")
    timer.start()
    assert timer.elapsed(reset=False) == pytest.approx(0.5)
    assert timer._started
    assert timer._elapsed == pytest.approx(0.5)


def test_timer_guards_start_stop_order(impl):
    timer = impl.Timer("optimizer")
    with pytest.raises(AssertionError, match="timer is not started"):
        timer.stop()
    timer.start()
    with pytest.raises(AssertionError, match="timer has already been started"):
        timer.start()


def test_timers_returns_real_or_dummy_timer_by_log_level(impl):
    timers = impl.Timers(log_level=1, log_option="max")
    real_timer = timers("train", log_level=1)
    assert isinstance(real_timer, impl.Timer)
    assert isinstance(timers("debug", log_level=2), impl.DummyTimer)
    assert timers("train") is real_timer
    with pytest.raises(AssertionError, match="does not match already existing"):
        timers("train", log_level=0)
    with pytest.raises(AssertionError, match="larger than max supported"):
        timers("too-high", log_level=3)


def test_timers_rejects_invalid_log_option(impl):
    with pytest.raises(AssertionError, match="input log option"):
        impl.Timers(log_level=1, log_option="median")


def test_timers_formats_max_and_minmax_strings(impl, one_rank_group):
    for option, expected in (("max", "max time across ranks (ms):\n    forward " + "." * 40 + ": 3000.00"),
                             ("minmax", "(min, max) time across ranks (ms):\n    forward " + "." * 40
                              + ": (3000.00, 3000.00)")):
        timers = impl.Timers(log_level=1, log_option=option)
        timers("forward", log_level=1).set_elapsed(3.0)
        timers("backward", log_level=1).set_elapsed(0.0)  # measured nothing: left out
        assert timers.get_all_timers_string(["forward", "backward"], reset=False) == expected


def test_timers_formats_all_rank_strings(impl, one_rank_group):
    timers = impl.Timers(log_level=1, log_option="all")
    timers("forward", log_level=1).set_elapsed(1.0)
    assert timers.get_all_timers_string(["forward"]) == "times across ranks (ms):\n  forward:\n     rank  0: 1000.00"


def test_timers_write_records_max_times(impl, one_rank_group):
    writer = recording_summary_writer()
    timers = impl.Timers(log_level=1, log_option="max")
    timers("forward", log_level=1).set_elapsed(4.0)
    timers.write(["forward"], writer=writer, iteration=7)
    assert writer.calls == [("forward-time", 4.0, 7)]  # seconds, the slowest rank's


def test_timers_log_defaults_to_last_rank(impl, one_rank_group, caplog, capsys):
    timers = impl.Timers(log_level=1, log_option="max")
    timers("forward", log_level=1).set_elapsed(0.5)
    expected = timers.get_all_timers_string(["forward"], reset=False)
    caplog.set_level(logging.INFO)
    timers.log(["forward"])
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [expected]
    assert capsys.readouterr().out == ""  # logging, not print


# --- Megatron's source, no upstream test ---------------------------------------------------------

def test_nothing_to_report_is_none(impl, one_rank_group):
    timers = impl.Timers(log_level=2, log_option="minmax")
    timers("zero", log_level=0).set_elapsed(0.0)
    assert timers.get_all_timers_string(["zero"]) is None
    assert timers.get_all_timers_string([]) is None


def test_padding_is_ljust_48_of_name_and_a_space(impl, one_rank_group):
    timers = impl.Timers(log_level=2, log_option="max")
    names = ["a", "n" * 46, "m" * 47, "k" * 48]
    for name in names:
        timers(name, log_level=0).set_elapsed(0.001)
    assert timers.get_all_timers_string(names).splitlines() == [
        "max time across ranks (ms):", "    a " + "." * 46 + ": 1.00", "    " + "n" * 46 + " .: 1.00",
        "    " + "m" * 47 + " : 1.00", "    " + "k" * 48 + " : 1.00"]


def test_reset_stops_a_running_timer(impl):
    timer = impl.Timer("x")
    timer.start()
    timer.reset()
    with pytest.raises(AssertionError, match="timer is not started"):
        timer.stop()


def test_set_elapsed_keeps_the_value_as_given(impl):
    timer = impl.Timer("startup")
    timer.set_elapsed(5)
    value = timer.elapsed()
    assert value == 5 and type(value) is int


def test_normalizer_must_be_positive(impl):
    timers = impl.Timers(1, "max")
    with pytest.raises(AssertionError):
        timers.get_all_timers_string(["x"], normalizer=0)
    with pytest.raises(AssertionError):
        timers.write(["x"], None, 1, normalizer=0)


def test_our_errors_are_caught_as_megatrons_and_name_the_timer():
    from distmetrics.collectors.timers import Timers, TimerError

    timer = Timers(1, "max")("forward", log_level=1)
    with pytest.raises(TimerError, match="timer is not started \\(timer 'forward'\\)") as caught:
        timer.stop()
    assert isinstance(caught.value, AssertionError) and isinstance(caught.value, RuntimeError)


LEVELS = [0, 1, 2, None, 1.0, 1.5, 2.0, 0.5, True, False, -1, -5, 2.5, 3]


def _kind(timers_module, timing_log_level: int, name: str, level):
    """What ``Timers(timing_log_level)(name, level)`` gives: a timer, the dummy, or an assertion."""
    try:
        made = timers_module.Timers(timing_log_level, "max")(name, log_level=level)
    except AssertionError as err:
        return "AssertionError", str(err)
    return type(made).__name__, ""


def test_a_log_level_is_compared_as_a_number_the_same_way_at_every_timing_log_level():
    """1.0, 1.5, True passed where disabled and raised once timing_log_level was raised; -5 passed
    though the message said "the integers 0 to 2". As Megatron's, any number up to 2 is a level,
    enabled where it is <= timing_log_level (True as 1), at every timing_log_level; above 2 Megatron's
    message, with the timer named; text and NaN refused at every level."""
    from distmetrics.collectors import timers as ours

    with megatron_timers_on_cpu() as megatron:
        for timing_log_level in (-1, 0, 1, 2):
            for i, level in enumerate(LEVELS):
                name = f"fwd/level{i}"
                mine, theirs = _kind(ours, timing_log_level, name, level), _kind(megatron, timing_log_level, name,
                                                                                   level)
                assert mine[0] == theirs[0], (timing_log_level, level, mine, theirs)
                assert mine[1].startswith(theirs[1]) and (not mine[1] or repr(name) in mine[1]), (mine, theirs)
            for level in ("1", float("nan")):
                with pytest.raises(ours.TimerError, match=r"timers\('fwd', log_level=.*accepted values are numbers "
                                                          r"up to 2"):
                    ours.Timers(timing_log_level, "max")("fwd", log_level=level)
    with pytest.raises(ours.TimerError, match=r"^log level 5 is larger than max supported log level 2 "
                                              r"\(timer 'fwd/rank3'\)$"):
        ours.Timers(2, "max")("fwd/rank3", log_level=5)
    timers = ours.Timers(1, "max")
    timer = timers("fwd", log_level=True)
    assert isinstance(timer, ours.Timer) and timers("fwd", log_level=1) is timer  # Megatron's equality: True == 1
