"""Timers on 4 real gloo ranks: ranks spend different, known times inside timers. The times are
a :class:`~tests.dist_utils.FakeClock`'s that each rank advances by its planned milliseconds,
read by the timers in place of ``time.perf_counter_ns``, so every reported value is exact."""

import inspect
import logging

import pytest

from tests.dist_utils import CollectiveCounter, FakeClock, quiet_config, run_ranks

WORLD = 4
TIMER_MS = {0: 20, 1: 60, 2: 40, 3: 30}  # forward-backward per step; rank 1 is the straggler
LOSS_MS = {2: 5, 3: 10}  # loss-compute per step, on the last pipeline stages only


def _base_config(option: str, **extra):
    return quiet_config(**{"log_interval": 2, "timing_log_level": 1, "timing_log_option": option,
                           "log_memory": True, **extra})


def _timed_run(clock: FakeClock, rank: int, option: str, extra_timers: int = 0, with_loss: bool = True,
               root: str = None) -> tuple:
    import distmetrics as dm

    sinks = dict(json_log=True, tensorboard=True, output_dir=f"{root}/{option}") if root else {}
    monitor = dm.Monitor(_base_config(option, **sinks))
    counts = []
    metrics = None
    for step in (1, 2, 3, 4):  # two log steps: the second is steady state (no negotiation)
        with monitor.timers("forward-backward", log_level=1):
            clock.advance(TIMER_MS[rank])
        if rank in LOSS_MS:
            with monitor.timers("loss-compute", log_level=1):
                clock.advance(LOSS_MS[rank])
        for i in range(extra_timers):
            with monitor.timers(f"extra-{i}", log_level=1):
                pass
        monitor.timers("fine", log_level=2).start()  # above the level: a no-op
        monitor.timers("fine", log_level=2).stop()
        with CollectiveCounter() as counter:
            metrics = monitor.step(step, loss=1.0 if with_loss else None)
        counts.append(counter.collectives)
    monitor.close()
    return metrics, counts


def _waiting_at_log_steps(clock: FakeClock, rank: int, option: str) -> list:
    """Each rank works TIMER_MS[rank] per step, nothing synchronising between log steps, so at a log
    step the faster ranks wait in its collectives for the slowest. The fake clock stands still in a
    real collective: the reducer's ``reduce`` (where the log step's collectives are) is wrapped to
    advance this rank's clock by its wait, the slowest rank's interval less its own, first."""
    import distmetrics as dm

    slowest = max(TIMER_MS.values())
    monitor = dm.Monitor(quiet_config(log_interval=2, timing_log_level=0, timing_log_option=option,
                                      log_throughput=True, straggler_window=2))
    reduce = monitor._reducer.reduce

    def waiting(*args, **kwargs):
        clock.advance(2 * (slowest - TIMER_MS[rank]))
        return reduce(*args, **kwargs)

    monitor._reducer.reduce = waiting
    seen = []
    for step in range(1, 7):
        clock.advance(TIMER_MS[rank])
        metrics = monitor.step(step)
        if metrics is not None:
            seen.append({k: (list(v) if isinstance(v, list) else v) for k, v in metrics.items()
                         if k.startswith(("timers/step", "stragglers/", "train/step_time_ms"))})
    monitor.close()
    return seen


def _scenarios(rank: int, world: int, root: str) -> dict:
    import distmetrics as dm

    out = {}
    with FakeClock() as clock:
        for option in ("max", "minmax", "all"):
            metrics, counts = _timed_run(clock, rank, option, root=root if option == "all" else None)
            out[option] = {k: (list(v) if isinstance(v, list) else v) for k, v in metrics.items()}
            out[f"{option}_counts"] = counts
        _, out["counts_50_timers"] = _timed_run(clock, rank, "minmax", extra_timers=50)
        out["waiting"] = {option: _waiting_at_log_steps(clock, rank, option) for option in ("minmax", "all")}

        # A Megatron-style block through our Timers.log (a collective: every rank calls it).
        monitor = dm.Monitor(_base_config("minmax"))
        with monitor.timers("optimizer", log_level=1):
            clock.advance(rank + 1)
        out["megatron_block"] = monitor.timers.get_all_timers_string(["optimizer"])
        monitor.close()
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("timers")


@pytest.fixture(scope="module")
def results(root):
    return run_ranks(_scenarios, WORLD, str(root), timeout=300)


def test_max_option_reports_the_slowest_rank_per_step(results):
    m = results[0]["max"]
    assert m["timers/forward-backward"] == pytest.approx(TIMER_MS[1])
    assert m["timers/forward-backward/max_rank"] == 1
    assert "timers/forward-backward/min" not in m
    assert "stragglers/forward-backward/rank" not in m  # the report comes with minmax/all


def test_minmax_reports_both_extremes_their_ranks_and_the_straggler(results):
    m = results[0]["minmax"]
    assert m["timers/forward-backward"] == pytest.approx(TIMER_MS[1])
    assert m["timers/forward-backward/min"] == pytest.approx(TIMER_MS[0])
    assert m["timers/forward-backward/max_rank"] == 1 and m["timers/forward-backward/min_rank"] == 0
    assert m["stragglers/forward-backward/rank"] == 1
    import socket

    assert m["stragglers/forward-backward/host"] == socket.gethostname()
    assert m["stragglers/forward-backward/local_rank"] == 1
    mean = sum(TIMER_MS.values()) / WORLD
    assert m["stragglers/forward-backward/max_over_mean"] == pytest.approx(TIMER_MS[1] / mean)


def test_all_reports_every_ranks_value_and_the_median_ratio(results):
    m = results[0]["all"]
    assert m["timers/forward-backward"] == pytest.approx([TIMER_MS[rank] for rank in range(WORLD)])
    assert m["stragglers/forward-backward/rank"] == 1
    median = sorted(TIMER_MS.values())[1:3]
    assert m["stragglers/forward-backward/max_over_median"] == pytest.approx(TIMER_MS[1] / (sum(median) / 2))


def test_all_option_puts_the_same_summary_names_in_jsonl_and_tensorboard(results, root):
    import distmetrics as dm
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    record = [r for r in dm.read_jsonl(root / "all" / "metrics.jsonl") if r["kind"] == "train"][-1]
    for stat in ("max", "min", "mean"):
        assert f"timers/forward-backward/{stat}" in record
    assert record["timers/forward-backward/max"] == pytest.approx(TIMER_MS[1])
    assert record["timers/forward-backward/min"] == pytest.approx(TIMER_MS[0])
    assert record["timers/forward-backward/mean"] == pytest.approx(sum(TIMER_MS.values()) / WORLD)
    assert record["timers/forward-backward/rank1"] == record["timers/forward-backward/max"]
    assert record["timers/loss-compute/min"] == pytest.approx(LOSS_MS[2])  # ranks that never ran it are not a 0
    acc = EventAccumulator(str(root / "all" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {f"timers/forward-backward/{stat}" for stat in ("max", "min", "mean")} <= tags
    assert {k for k in record if k.startswith("timers/") and "/rank" not in k} <= tags | {"timers/step"}


def test_a_timer_run_on_some_ranks_only_is_left_out_of_the_min(results):
    m = results[0]["minmax"]
    assert m["timers/loss-compute/min_rank"] == 2 and m["timers/loss-compute/max_rank"] == 3
    assert m["timers/loss-compute/min"] == pytest.approx(LOSS_MS[2])  # ranks 0 and 1 did not count as 0
    per_rank = results[0]["all"]["timers/loss-compute"]
    assert per_rank[:2] == [None, None] and per_rank[2:] == pytest.approx([LOSS_MS[2], LOSS_MS[3]])


def test_levels_gate_which_timers_exist(results):
    for option in ("max", "minmax", "all"):
        m = results[0][option]
        assert not any(k.startswith("timers/fine") for k in m)
        assert "timers/step" in m or "timers/step/min" in m or isinstance(m.get("timers/step"), list)


def test_one_collective_carries_every_timer(results):
    # Log step 4: the MAX pack (all timers, any number) and the SUM pack (loss, timer means).
    assert results[0]["minmax_counts"][3] == 2
    assert results[0]["counts_50_timers"][3] == 2
    assert results[0]["minmax_counts"][2] == 0  # step 3 is not a log step


def test_the_wait_for_the_slowest_rank_at_a_log_step_is_left_out_of_timers_step(results):
    """timers/step is each rank's own time per step: the wait inside a log step's collectives for the
    slowest rank fell into the next step of every faster rank, so every rank read 60 ms, and its
    straggler fields named rank 0 (the fastest) at a ratio of 1.0 and a score of 1.0. Rank 1 works
    60 ms a step, the others 20, 40 and 30; train/step_time_ms (with log_throughput: wall time, the
    wait included) is the slowest rank's 60 ms, timers/step's max. The FakeClock stands in for the
    clocks and the reducer's ``reduce`` is wrapped to advance it by each rank's wait (see
    :func:`_waiting_at_log_steps`)."""
    own = [TIMER_MS[rank] for rank in range(WORLD)]
    mean, median = sum(own) / WORLD, sorted(own)[1:3]
    for option in ("minmax", "all"):
        seen = results[0]["waiting"][option]
        assert all(r["waiting"][option] == seen for r in results)  # the same on every rank
        for metrics in seen:
            if option == "all":
                assert metrics["timers/step"] == pytest.approx(own), (option, metrics)
                ratio = pytest.approx(own[1] / (sum(median) / 2))
                assert metrics["stragglers/step/max_over_median"] == ratio
            else:
                assert metrics["timers/step"] == pytest.approx(own[1]) and metrics["timers/step/min"] == \
                    pytest.approx(min(own)) and metrics["timers/step/min_rank"] == 0, (option, metrics)
                assert metrics["stragglers/step/max_over_mean"] == pytest.approx(own[1] / mean)
            assert metrics["stragglers/step/rank"] == 1, (option, metrics)
            assert metrics["stragglers/step/score_min"] == pytest.approx(min(own) / own[1])
            assert metrics["stragglers/step/score_min_rank"] == 1
            assert metrics["stragglers/score_min"] == pytest.approx(min(own) / own[1])  # the interval clock's
            assert metrics["train/step_time_ms"] == pytest.approx(own[1])


def test_megatron_text_block(results):
    block = results[-1]["megatron_block"]
    lines = block.splitlines()
    assert lines[0] == "(min, max) time across ranks (ms):"
    name, values = lines[1].split(":")
    assert name.strip().startswith("optimizer ....")
    assert values == " (1.00, 4.00)"  # rank r ran the timer r + 1 ms


# --- single-process behaviour ------------------------------------------------------------------

def _timers(level=2, option="minmax"):
    from distmetrics.collectors.timers import Timers

    return Timers(level, option, use_cuda=False)


@pytest.fixture
def clock():
    """A :class:`FakeClock` read by the timers in place of ``time.perf_counter_ns``."""
    with FakeClock() as fake:
        yield fake


def test_repeated_start_stop_accumulates_like_megatron(clock):
    timers = _timers()
    t = timers("x", log_level=1)
    for _ in range(3):
        t.start()
        clock.advance(10.0)
        t.stop()
        clock.advance(5.0)  # between spans: not counted
    assert t.elapsed(reset=False) == pytest.approx(0.03)
    assert t.elapsed(reset=True) == pytest.approx(0.03)  # reset after reading
    assert t.elapsed() == 0.0
    assert t.active_time() == pytest.approx(0.03)  # active time survives resets


def test_elapsed_on_a_running_timer_keeps_it_running(clock):
    timers = _timers()
    t = timers("x", log_level=0)
    t.start()
    clock.advance(10.0)
    assert t.elapsed() == pytest.approx(0.01)
    clock.advance(20.0)
    t.stop()
    assert t.elapsed() == pytest.approx(0.02)


def test_nested_timers_contain_each_other(clock):
    timers = _timers()
    with timers("outer", log_level=1):
        clock.advance(5.0)
        with timers("inner", log_level=2):
            clock.advance(10.0)
    assert timers("outer").elapsed() == pytest.approx(0.015)
    assert timers("inner").elapsed() == pytest.approx(0.010)


def test_stop_without_start_raises_megatrons_assertion_with_the_timer_named():
    timers = _timers()
    with pytest.raises(AssertionError, match="timer is not started \\(timer 'x'\\)"):
        timers("x", log_level=1).stop()
    timers("y", log_level=1).start()
    with pytest.raises(RuntimeError, match="timer has already been started \\(timer 'y'\\)"):
        timers("y").start()


def test_a_disabled_timer_is_the_shared_dummy():
    from distmetrics.collectors.timers import DummyTimer

    timers = _timers(level=0)
    assert isinstance(timers("x", log_level=1), DummyTimer)
    assert timers("x", log_level=2) is timers("y", log_level=1)
    with timers("x", log_level=1):
        pass


def test_log_level_mismatch_and_bad_options_are_refused():
    timers = _timers()
    timers("x", log_level=1)
    with pytest.raises(AssertionError, match="input log level 2 does not match already existing log level 1 for x"):
        timers("x", log_level=2)
    with pytest.raises(AssertionError, match="input log option median is invalid"):
        _timers(option="median")


def test_same_interface_as_megatron_core_timers():
    """Every public method of Megatron-Core's Timers and Timer takes the same parameters here."""
    from megatron.core import timers as megatron

    from distmetrics.collectors import timers as ours

    for theirs, mine in ((megatron.Timers, ours.Timers), (megatron.Timer, ours.Timer)):
        for name, method in inspect.getmembers(theirs, inspect.isfunction):
            if name.startswith("_") and name != "__call__":
                continue
            assert hasattr(mine, name), f"{mine.__name__}.{name} is missing"
            their_params = [p for p in inspect.signature(method).parameters if p != "self"]
            my_params = [p for p in inspect.signature(getattr(mine, name)).parameters if p != "self"]
            assert my_params[: len(their_params)] == their_params, f"{name}: {my_params} vs {their_params}"


def test_write_sends_megatron_tags_to_a_writer(clock):
    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    timers = _timers()
    with timers("optimizer", log_level=1):
        clock.advance(2.0)
    writer = Writer()
    timers.write(["optimizer"], writer, 7)
    assert writer.scalars == [("optimizer-time", pytest.approx(0.002), 7)]  # seconds, as Megatron writes


def test_console_prints_megatrons_min_max_block(caplog, tmp_path, clock):
    import distmetrics as dm

    caplog.set_level(logging.INFO, logger="distmetrics.console")
    monitor = dm.Monitor(_base_config("minmax", console=True, output_dir=str(tmp_path), log_interval=1))
    with monitor.timers("forward-backward", log_level=1):
        clock.advance(2.0)
    monitor.step(1, loss=1.0)
    monitor.close()
    text = caplog.text
    assert "(min, max) time across ranks (ms):" in text
    assert "    forward-backward ......" in text and ": (2.00, 2.00)" in text


def test_a_timer_running_across_log_steps_is_split_at_each_as_megatron_core_splits_it(clock):
    """A span started at step 3 and stopped at step 6 (100 ms steps, log_interval 4): each log
    step gets the share it holds, as megatron-core's Timers read with elapsed() at every log step
    on the same clock (50 then 25 ms per step), not 0 and then the whole span."""
    import types

    import torch

    import distmetrics as dm

    pytest.importorskip("megatron.core")
    from megatron.core import timers as megatron_timers

    ours, theirs = [], []
    real_time, real_sync = megatron_timers.time, torch.cuda.synchronize
    megatron_timers.time = types.SimpleNamespace(time=clock.perf_counter)  # Megatron reads time.time()
    torch.cuda.synchronize = lambda *a, **k: None  # no-op on this CPU-only build (Megatron calls it)
    try:
        reference = megatron_timers.Timers(log_level=2, log_option="max")
        with dm.Monitor(quiet_config(log_interval=4, timing_log_level=1, timing_log_option="minmax")) as monitor:
            for step in range(1, 13):
                if step == 3:
                    monitor.timers("span", log_level=1).start()
                    reference("span", log_level=1).start()
                if step == 6:
                    monitor.timers("span", log_level=1).stop()
                    reference("span", log_level=1).stop()
                clock.advance(100.0)
                metrics = monitor.step(step)
                if metrics is not None:
                    ours.append(metrics.get("timers/span"))
                    theirs.append(reference("span", log_level=1).elapsed(reset=True) * 1000 / 4 or None)
    finally:
        megatron_timers.time, torch.cuda.synchronize = real_time, real_sync
    assert ours == pytest.approx(theirs) and ours[:2] == pytest.approx([50.0, 25.0]) and ours[2] is None


def test_reading_the_step_timer_in_a_megatron_report_leaves_timers_step_alone(clock):
    """``timers.log()`` (every timer, ``step`` included) reads a running timer with elapsed(),
    which stops and restarts it: that is not a step ending, so timers/step stays 100 ms."""
    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=4, timing_log_level=1, log_throughput=False)) as monitor:
        for step in range(1, 9):
            clock.advance(100.0)
            monitor.timers.get_all_timers_string(normalizer=1.0)
            metrics = monitor.step(step)
    assert metrics["timers/step"] == pytest.approx(100.0) and metrics["train/step_time_ms"] == pytest.approx(100.0)


def test_a_user_timer_named_step_is_refused_with_the_reason_and_the_step_timer_keeps_timing(clock):
    """``timers("step")`` is the Monitor's step timer: reading it works, but starting or stopping
    it by hand (a user's own timer of that name) would cut the steps it times, so each raises a
    TimerError that names it and says what to do; timers/step is left as it was."""
    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=2, timing_log_level=1, log_throughput=False)) as monitor:
        for step in range(1, 5):
            clock.advance(100.0)
            for use in (lambda t: t.start(), lambda t: t.stop(), lambda t: t.__enter__()):
                with pytest.raises(AssertionError, match="'step' is the Monitor's step timer.*another name"):
                    use(monitor.timers("step"))
            for level in (1, 2):  # a level given: a log level's mismatch was said instead (2: disabled here)
                with pytest.raises(AssertionError, match="'step' is the Monitor's step timer.*another name"):
                    monitor.timers("step", level)
            assert monitor.timers("step").elapsed(reset=False) >= 0.0
            metrics = monitor.step(step)
        assert metrics["timers/step"] == pytest.approx(100.0)
        with monitor.timers("train-step", log_level=0):  # another name is the user's own
            clock.advance(30.0)


def test_a_reset_of_the_step_timer_keeps_it_timing_the_steps(clock):
    """Megatron's ``reset()`` stops a timer: on the step timer (code that resets every timer after each step)
    it stopped timing, and the records at steps 4, 8 and 12 had no timers/step (one reset: the interval
    was averaged over fewer steps). It forgets the time since the last reset and keeps running."""
    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=4, timing_log_level=1, log_throughput=False)) as monitor:
        records = []
        for step in range(1, 9):
            clock.advance(10.0 * step)
            records.append(monitor.step(step))
            clock.advance(1.0)
            monitor.timers("step").reset()
            assert monitor.timers("step").elapsed(reset=False) == 0.0
    assert [r["timers/step"] for r in records if r is not None] == [pytest.approx((20 + 30 + 40 + 3) / 3),
                                                                      pytest.approx((50 + 60 + 70 + 80 + 4) / 4)]


def test_timing_log_level_minus_1_turns_every_timer_off_a_negative_levels_too(clock):
    """At -1 ("off") a timer of a level below 0 was a real one: timers/<name>, straggler scores and the
    console block came back, and a user's timer named 'step' (the Monitor makes none at -1) filled
    train/step_time_ms with its own time. Every timer is the dummy there now."""
    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=2, timing_log_level=-1, log_throughput=False)) as monitor:
        for step in range(1, 5):
            for name, level in (("step", -1), ("neg5", -5), ("fwd", None)):
                with monitor.timers(name, log_level=level):
                    clock.advance(2.0)
            clock.advance(4.0)
            metrics = monitor.step(step)
    assert not [key for key in metrics if key.startswith(("timers/", "stragglers/")) or key == "train/step_time_ms"], \
        metrics


def test_cuda_timer_event_pairs_are_let_go_at_each_log_step(clock, monkeypatch):
    """With use_cuda (torch.cuda.Event replaced by a stand-in that counts live events: no GPU
    here), the start/end pairs are read at every log step and let go; before, a run that never
    called elapsed() kept one pair per timer per step."""
    import torch

    import distmetrics as dm

    class Event:
        live = 0

        def __init__(self, enable_timing=False):
            Event.live += 1

        def __del__(self):
            Event.live -= 1

        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    with dm.Monitor(quiet_config(log_interval=10, timing_log_level=1)) as monitor:
        timers = monitor.timers
        timers._use_cuda = timers._timers["step"]._use_cuda = True
        for step in range(1, 1001):
            with timers("fwd", log_level=1):
                pass
            monitor.step(step)
        assert len(timers._timers["fwd"]._pending) == 0 and Event.live < 10
        assert monitor.last_metrics["timers/fwd"] == pytest.approx(1.0)


def _clock_events(clock):
    """A stand-in for ``torch.cuda.Event`` (no GPU here): an event records the FakeClock's
    reading, ``elapsed_time`` is the difference in milliseconds, and ``made`` counts events."""

    class Event:
        made = 0

        def __init__(self, enable_timing=False):
            Event.made += 1
            self.ns = None

        def record(self, stream=None):
            self.ns = clock.ns

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.ns - self.ns) / 1e6

    return Event


def test_the_record_close_writes_ends_at_the_last_monitor_step_not_at_close(clock, monkeypatch):
    """A final checkpoint save or teardown between the last monitor.step and close() is no step's
    time: the close record's train/step_time_ms, tokens/s, timers/step and the straggler clock's
    milliseconds per step cover steps 11-12 only (100 ms each), not the 60 s after them, whether
    or not the save was paused (and resumed) as the README says, nor an evaluation paused
    between them, nor where a report read the step timer during the save (it counted the 30 s before
    the read, 3 s per step). CUDA
    events stand in (no GPU here): the lapped step timer records no event at its last lap, so
    on CUDA the close record leaves timers/step out rather than count the 60 s."""
    import torch

    import distmetrics as dm
    from distmetrics.collectors.stragglers import STEP_MS, StragglerCollector

    class Recorded(StragglerCollector):
        def take_samples(self, ctx):
            samples = super().take_samples(ctx)
            self.step_ms = next(s.value for s in samples if s.name == STEP_MS)
            return samples

    monkeypatch.setattr(torch.cuda, "Event", _clock_events(clock))
    for cuda, after in ((False, "save"), (True, "save"), (False, "paused save"), (False, "paused, not resumed"),
                        (False, "report"), (True, "report"), (False, "read")):
        stragglers = Recorded(window=2)
        with dm.Monitor(quiet_config(log_interval=5, timing_log_level=0, log_throughput=True),
                        collectors=[stragglers]) as monitor:
            monitor.timers._timers["step"]._use_cuda = cuda
            for step in range(1, 13):
                metrics = monitor.step(step, loss=1.0, tokens=1000)
                if step == 11:  # an evaluation in the interval, paused as the README says: not step time
                    monitor.pause()
                    clock.advance(500.0)
                    monitor.resume()
                clock.advance(100.0)
            assert metrics is None and stragglers.step_ms == pytest.approx(100.0)  # log step 10
            if after.startswith("paused"):
                monitor.pause()
            if after in ("report", "read"):  # a report of every timer (the step timer too) during the save
                clock.advance(30_000.0)  # split the running span there: that share was counted as step time
                monitor.timers.log() if after == "report" else monitor.timers("step").elapsed(reset=False)
            clock.advance(60_000.0 - 100.0 - (30_000.0 if after in ("report", "read") else 0.0))  # the final save:
            # close() comes 60 s after step 12
            if after == "paused save":
                monitor.resume()
        last = monitor.last_metrics
        assert last["train/step_time_ms"] == pytest.approx(100.0), (cuda, after)
        assert last["train/tokens_per_sec"] == pytest.approx(10_000.0), (cuda, after)
        assert stragglers.step_ms == pytest.approx(100.0), (cuda, after)
        if cuda:
            assert "timers/step" not in last
        else:  # the step timer times monitor.step to monitor.step, a paused evaluation left out
            assert last["timers/step"] == pytest.approx(100.0)


def test_a_paused_evaluation_is_left_out_of_the_step_timer_as_megatron_stops_its_interval_timer(clock, monkeypatch):
    """Megatron stops its interval timer around evaluation and checkpoint saves; monitor.pause()
    does the same to timers/step, so train/step_time_ms reads alike with or without
    log_throughput (it came from the step timer without it: 350 ms for steps of 100 ms). A pause
    not resumed lasts to the log step, as the throughput clock's. CUDA events stand in (no GPU)."""
    import torch

    import distmetrics as dm

    monkeypatch.setattr(torch.cuda, "Event", _clock_events(clock))
    for cuda in (False, True):
        for throughput in (True, False):
            seen = []
            with dm.Monitor(quiet_config(log_interval=4, timing_log_level=0, log_throughput=throughput)) as monitor:
                monitor.timers._timers["step"]._use_cuda = cuda
                for step in range(1, 13):
                    clock.advance(100.0)
                    metrics = monitor.step(step, loss=1.0, tokens=10)
                    if step == 6:  # a 1 s evaluation, paused and resumed
                        monitor.pause()
                        monitor.pause()  # a second pause changes nothing
                        clock.advance(1000.0)
                        monitor.resume()
                    if step == 10:  # paused, not resumed: to the log step at 12, then counted again
                        monitor.pause()
                        clock.advance(2000.0)
                    if metrics is not None:
                        seen.append((metrics["timers/step"], metrics["train/step_time_ms"]))
                clock.advance(100.0)
                monitor.step(13, loss=1.0, tokens=10)  # counted again after the log step at 12
                clock.advance(100.0)
                monitor.pause()
                clock.advance(5000.0)  # a final save after the last step, paused and resumed
                monitor.resume()
                clock.advance(3000.0)
            last = monitor.last_metrics
            seen.append((last.get("timers/step"), last.get("train/step_time_ms")))
            # steps 9-12: only 8-10 counted (200 ms over 4 steps); close(): step 12 to 13
            expected = [(100.0, 100.0), (100.0, 100.0), (50.0, 50.0), (100.0, 100.0)]
            if cuda:  # the pause after step 13 cannot be told from the laps before it: no timers/step
                expected[-1] = (None, 100.0 if throughput else None)
            assert seen == [tuple(pytest.approx(v) if v is not None else None for v in pair) for pair in expected], \
                (cuda, throughput, seen)


def test_the_step_timer_laps_without_cuda_events_and_reads_them_at_log_steps(clock, monkeypatch):
    """CUDA events stand in (no GPU here): an event records the FakeClock's reading and
    ``elapsed_time`` is the difference. Between log steps the step timer records no event; its
    laps are read at the log step (``timers/step``) and by ``elapsed()`` as the CPU timer reads
    the same steps."""
    import torch

    import distmetrics as dm

    Event = _clock_events(clock)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    seen = {}
    for cuda in (False, True):
        with dm.Monitor(quiet_config(log_interval=4, timing_log_level=0, log_throughput=False)) as monitor:
            timer = monitor.timers._timers["step"]
            timer._use_cuda = cuda
            seen[cuda] = []
            for step in range(1, 9):
                made = Event.made
                metrics = monitor.step(step)
                if step % 4 and step > 1:
                    assert Event.made == made, step  # a lap between log steps records nothing
                clock.advance(10.0 * step)  # step s lasts 10·s ms
                if metrics is not None:
                    seen[cuda].append(metrics["timers/step"])
                if step == 6:
                    seen[cuda].append(timer.active_time() * 1000)
                    seen[cuda].append(timer.elapsed(reset=False) * 1000)
    # log step 4: (10+20+30)/3; at step 6 the active time: the completed spans on CPU (10..50),
    # up to now on CUDA (10..60); elapsed(): every span so far; log step 8: (40+50+60+70)/4
    assert seen[False] == pytest.approx([20.0, 150.0, 210.0, 55.0])
    assert seen[True] == pytest.approx([20.0, 210.0, 210.0, 55.0])


def _three_laps_and_4_ms(clock, cuda: bool):
    """A timer started, lapped after 10, 20 and 30 ms, and 4 ms into its next step (on CUDA with
    the stand-in events the caller installed)."""
    from distmetrics.collectors.timers import Timers

    timer = Timers(log_level=0, use_cuda=False)("t", log_level=0)
    timer._use_cuda = cuda
    timer.start()
    for _ in range(3):
        clock.advance(10.0)
        timer.lap()
    clock.advance(4.0)
    return timer


def test_a_lapped_cuda_timer_reads_as_the_cpu_timer_after_set_elapsed_and_stop(clock, monkeypatch):
    """Stand-in CUDA events on the FakeClock (no GPU here). ``set_elapsed`` on a timer with
    unread laps sets the time since now (the laps before it count in active time only; the CPU
    timer adds the running span whole, as Megatron's), and
    ``stop`` covers the laps, so a later read records no further event, as the CPU timer reads."""
    import torch
    Event = _clock_events(clock)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    seen = {}
    for cuda in (False, True):
        timer = _three_laps_and_4_ms(clock, cuda)
        timer.set_elapsed(1.0)
        clock.advance(10.0)
        timer.lap()
        clock.advance(5.0)
        timer.stop()
        made = Event.made
        timer.start()
        clock.advance(7.0)
        active, events = timer.active_time(), Event.made - made
        seen[cuda] = [timer.elapsed(reset=False), active, events]
    # elapsed: 1 s set 4 ms into a step, then that step (the CPU timer, as Megatron's: 4 + 10 ms;
    # CUDA, split at the call: 10 ms), 5 ms and the running 7 ms; active time: every completed
    # span (30 + 14 + 5 ms); on CUDA one event for the start after stop() and none for active_time()
    assert seen[False] == pytest.approx([1.026, 0.049, 0])
    assert seen[True] == pytest.approx([1.022, 0.049, 1])


def test_reset_on_a_lapped_cuda_timer_counts_its_running_span_as_documented(clock, monkeypatch):
    """Stand-in CUDA events on the FakeClock (no GPU here). Three 10 ms laps, then ``reset()`` 4 ms
    into the next step: the CPU timer drops the running span (as Megatron's); the CUDA timer,
    with no event at its last lap, counts it in the interval and in active time, not as a span,
    so the interval's ms per step is high by 4/3 ms (at most one step's share, as its docstring says)."""
    import torch
    monkeypatch.setattr(torch.cuda, "Event", _clock_events(clock))
    seen = {}
    for cuda in (False, True):
        timer = _three_laps_and_4_ms(clock, cuda)
        timer.reset()
        spans = timer.spans
        seen[cuda] = [timer.take_interval_ms() / spans, timer.active_time() * 1000, timer.elapsed()]
    assert seen[False] == pytest.approx([10.0, 30.0, 0.0])
    assert seen[True] == pytest.approx([34.0 / 3, 34.0, 0.0])


def _empty_names_report(rank, world):
    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=2, timing_log_level=1, hang_timeout_s=20))
    with monitor.timers("opt", log_level=1):
        pass
    text = monitor.timers.get_all_timers_string([] if rank == 0 else ["opt"])
    metrics = [monitor.step(step) for step in (1, 2)]
    monitor.close()
    return text, metrics[1] is not None


def test_a_rank_asking_a_report_for_no_timers_still_joins_the_others():
    """One rank asks for [] and the other for ["opt"]: the rank with none joins the gather (it
    returned early before and the other waited until the hang check fired), and its text holds
    the union too."""
    (text0, logged0), (text1, logged1) = run_ranks(_empty_names_report, 2, timeout=120)
    assert "opt" in text1 and text0 == text1 and logged0 and logged1


def _union_reports(rank, world):
    import distmetrics as dm

    texts = []
    with FakeClock() as clock:
        monitor = dm.Monitor(quiet_config(log_interval=100, timing_log_level=1))

        def run(name, ms):
            with monitor.timers(name, log_level=1):
                clock.advance(ms[rank])

        run("fwd", [10, 10])
        run("bwd", [100, 40])
        texts.append(monitor.timers.get_all_timers_string(["fwd"] if rank == 0 else ["fwd", "bwd"]))
        run("bwd", [7, 9])
        texts.append(monitor.timers.get_all_timers_string(["bwd"]))
        run("bwd", [5, 6])
        texts.append(monitor.timers.get_all_timers_string(["fwd"]))  # bwd asked by no rank: kept
        texts.append(monitor.timers.get_all_timers_string(["bwd"]))
        monitor.close()
    return texts


def test_a_report_of_names_one_rank_did_not_ask_for_holds_that_ranks_time():
    """Rank 0 asks for fwd, rank 1 for fwd and bwd (the union is reported, on both): rank 0 sent 0
    for its bwd, so rank 1 printed (40, 40) for a slowest rank at 100 ms, and rank 0's bwd, not
    read, reported 107 ms at the next report."""
    texts = run_ranks(_union_reports, 2, timeout=120)

    def bwd(text):
        return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.strip().startswith("bwd")]

    assert bwd(texts[1][0]) == ["(40.00, 100.00)"] and bwd(texts[0][0]) == ["(40.00, 100.00)"]
    assert [bwd(texts[r][1]) for r in (0, 1)] == [["(7.00, 9.00)"]] * 2
    assert [bwd(texts[r][3]) for r in (0, 1)] == [["(5.00, 6.00)"]] * 2


def _running_timer_read_for_another_rank(rank, world):
    import distmetrics as dm
    from distmetrics.collectors import timer_reports

    gather = timer_reports._all_gather_rows
    with FakeClock() as clock:
        def waited(*args, **kwargs):  # rank 0 waits 300 ms in the gather for rank 1
            clock.advance(300 if rank == 0 else 0)
            return gather(*args, **kwargs)

        timer_reports._all_gather_rows = waited
        try:
            monitor = dm.Monitor(quiet_config(log_interval=100, timing_log_level=1))
            timers = monitor.timers
            timers("fwd", log_level=1).start()
            timers("fwd").stop()
            timers.get_all_timers_string(["fwd", "bwd"] if rank else ["fwd"])  # the names agreed: bwd is known
            bwd = timers("bwd", log_level=1)
            bwd.start()
            clock.advance(40)
            texts = [timers.get_all_timers_string(["fwd"] if rank == 0 else ["bwd"])]
            clock.advance(100)
            texts.append(timers.get_all_timers_string(["bwd"]))
            bwd.stop()
            active_ms, left_ms = bwd.active_time() * 1e3, bwd.elapsed(reset=False) * 1e3
            monitor.close()
        finally:
            timer_reports._all_gather_rows = gather
    return texts, active_ms, left_ms


def test_a_running_timer_read_for_another_rank_keeps_the_time_after_its_reading():
    """A running timer this rank did not ask for was read before the gather and reset after it: the time
    between (the gather's wait: 300 ms) was counted in no report: rank 0's second report said 100 ms, not 400.
    Its reports and what it holds now add up to its time."""
    for rank, (texts, active_ms, left_ms) in enumerate(run_ranks(_running_timer_read_for_another_rank, 2,
                                                                 timeout=120)):
        bwd = [[line.split(":", 1)[1].strip() for line in text.splitlines() if line.strip().startswith("bwd")]
               for text in texts]
        assert bwd == [["(40.00, 40.00)"], ["(100.00, 400.00)"]], (rank, texts)
        if rank == 0:  # 40 ms, 300 in the gather, 100, and 300 in the second gather (for a next report)
            assert (active_ms, left_ms) == (740.0, 300.0)


UNION_S = {"fwd": (0.010, 0.020), "bwd": (0.030, 0.045)}  # seconds on rank 0, rank 1


def _different_names_beside_megatron(rank, world):
    """Rank 0 asks for fwd and bwd, rank 1 (the rank ``log`` prints on) for fwd only; Megatron-Core's
    Timers, given the same times, asked for both on every rank (with different names it hangs)."""
    import torch.distributed as dist

    import distmetrics as dm
    from tests.peer.conftest import megatron_timers_on_cpu, recording_summary_writer

    ask = ["fwd", "bwd"] if rank == 0 else ["fwd"]
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append((record.name.split(".")[0], record.getMessage()))
    loggers = [logging.getLogger("distmetrics.timers"), logging.getLogger("megatron.core.timers")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    out = {}
    with megatron_timers_on_cpu() as megatron:
        for option in ("max", "minmax", "all"):
            monitor = dm.Monitor(quiet_config(log_interval=100, timing_log_level=2, timing_log_option=option))
            both = {"ours": (monitor.timers, ask), "megatron": (megatron.Timers(2, option), list(UNION_S))}
            for impl, (timers, names) in both.items():
                for name, seconds in UNION_S.items():
                    timers(name, log_level=0).set_elapsed(seconds[rank])
                writer = recording_summary_writer()
                records.clear()
                text = timers.get_all_timers_string(names, reset=False)
                timers.write(names, writer, 7, reset=False)
                timers.log(names)  # resets every name some rank asked for
                out[option, impl] = {"text": text, "write": writer.calls, "log": list(records),
                                     "after": [timers(name).elapsed(reset=False) for name in UNION_S]}
                dist.barrier()
            monitor.close()
    for lg, level in zip(loggers, levels):
        lg.removeHandler(handler)
        lg.setLevel(level)
    return out


def test_ranks_asking_for_different_names_each_report_the_union_as_megatron_reports_it():
    """Rank 0 asked for bwd, rank 1 did not: rank 1's text (the one ``log`` prints) had fwd alone,
    though bwd was read and reset on every rank: it was printed nowhere. Every rank's text, log and
    write now hold the union, as Megatron-Core's do where every rank asks for it."""
    results = run_ranks(_different_names_beside_megatron, 2, timeout=240)
    for rank, out in enumerate(results):
        for option in ("max", "minmax", "all"):
            ours, theirs = out[option, "ours"], out[option, "megatron"]
            assert "bwd" in ours["text"] and ours["text"] == theirs["text"], (rank, option, ours["text"])
            assert ours["write"] == theirs["write"] and [c[0] for c in ours["write"]] == ["fwd-time", "bwd-time"]
            assert [m for _, m in ours["log"]] == [m for _, m in theirs["log"]], (rank, option)
            assert ours["after"] == theirs["after"] == [0.0, 0.0]
    assert [m for _, m in results[1]["minmax", "ours"]["log"]] == [results[1]["minmax", "megatron"]["text"]]
    assert results[0]["all", "ours"]["log"] == []  # only the last rank prints


@pytest.mark.parametrize("name", ["fwd/min", "fwd/max_rank", "a/rank3", "", "/fwd", "_x", "trail/", None, 5,
                                  "a//b", " ", "a\nb", "\x00", "load\x85data", "a\u2028b", "load-\udcff.bin"])
def test_a_timer_name_that_is_another_timers_key_or_no_name_is_refused(name):
    """A timer named ``fwd/min`` overwrote ``timers/fwd/min`` (3 ms for fwd's 10-12 ms) and, with
    straggler scores on, made every log step raise; "", None and 5 made keys such as ``timers/``.
    ``a//b`` (an empty part of the name), blank text and control characters (a newline split the
    console's timer block) passed; so did C1 controls and U+2028 (lines of metrics.jsonl split there for
    str.splitlines) and text that is not valid UTF-8 (a file's name, os.fsdecode: W&B turned off for good)."""
    from distmetrics.collectors.timers import TimerError, Timers

    timers = Timers(log_level=2)
    with pytest.raises(TimerError, match="is refused"):
        timers(name, log_level=0)
    timers("fwd-min", log_level=0).start()  # Megatron's names pass
    timers("optimizer/inner", log_level=0).start()
    disabled = Timers(log_level=0)  # the shipped timing_log_level: levels 1 and 2 give the dummy timer
    for level in (1, 2, None):  # a bad name passed there until someone raised the level
        with pytest.raises(TimerError, match="is refused"):
            disabled(name, log_level=level)
    assert disabled("fwd-min", log_level=2) is disabled("fwd-min", log_level=1)  # the dummy, as before


def test_a_tie_for_the_slowest_rank_names_the_lowest_under_every_option():
    """Under ``all`` the straggler of a timer that two ranks took equally long for was the highest of
    them (rank 1), under ``minmax`` the lowest (rank 0: the MAX pack's keys prefer it)."""
    from distmetrics.collectors.base import LogContext
    from distmetrics.collectors.timer_collector import TimerCollector
    from distmetrics.collectors.timers import Timers
    from distmetrics.per_rank import PerRank

    collector = TimerCollector(Timers(log_level=0, log_option="all", use_cuda=False), "all")
    metrics = {"timers/fwd": PerRank([10.0, 10.0, 4.0])}
    collector.finalize(metrics, LogContext(step=1, steps=1, layout=None))
    assert metrics["stragglers/fwd/rank"] == 0


def test_a_name_asked_at_a_disabled_level_then_an_enabled_one_counts_once_toward_the_warning(caplog):
    """600 names asked at a disabled level, then the same 600 at an enabled one, said "1000 timer names
    so far": each name counted twice. Distinct names are counted, and the warning comes once."""
    from distmetrics.collectors.timers import MANY_TIMERS, Timers

    caplog.set_level(logging.WARNING, logger="distmetrics")
    timers = Timers(1, "minmax")
    half = MANY_TIMERS // 2 + 100
    for level in (2, 1):
        for i in range(half):
            timers(f"x_{i}", level)
    assert not [r for r in caplog.records if "timer names so far" in r.getMessage()]
    for i in range(half, MANY_TIMERS + 10):  # one at a disabled level, the next at an enabled one
        timers(f"x_{i}", 1 + i % 2)
        timers(f"x_{i}", 1)
    said = [r.getMessage() for r in caplog.records if "timer names so far" in r.getMessage()]
    assert len(said) == 1 and f"'x_{MANY_TIMERS - 1}'" in said[0], said


def test_a_timer_named_per_step_is_said_once_and_the_log_step_reads_only_the_timers_used(caplog):
    """``timers(f"fwd_{step}")`` (a name made per step by mistake) kept a timer per name, and every
    log step went through every timer ever made: its cost grew with the run, with no word. The log
    step reads the timers used since the last one (and those still running); a warning at the user's
    1,000th name says what is wrong (it came at the 999th: the Monitor's step timer was counted).
    Each record holds the step's own timer and the step timer."""
    import distmetrics as dm
    from distmetrics.collectors.timers import MANY_TIMERS

    caplog.set_level(logging.WARNING, logger="distmetrics")
    held = {}
    with dm.Monitor(quiet_config(log_interval=1, timing_log_level=1, log_throughput=False)) as monitor:
        long_running = monitor.timers("load", log_level=1)
        long_running.start()  # across every log step: read at each
        for step in range(1, MANY_TIMERS + 5):
            with monitor.timers(f"fwd_{step}", log_level=1):
                pass
            metrics = monitor.step(step)
            held[step] = (len(monitor.timers.in_use), sorted(k for k in metrics if k.startswith("timers/")
                                                              and k.count("/") == 1))
        long_running.stop()
    assert max(used for used, _ in held.values()) == 2  # after each log step: the step timer and load
    assert all(names == sorted([f"timers/fwd_{step}", "timers/load", "timers/step"]) for step, (_, names)
               in held.items() if step > 1), held[2]
    said = [r.getMessage() for r in caplog.records if "timer names so far" in r.getMessage()]
    assert len(said) == 1 and "'fwd_999'" in said[0], said  # load and fwd_1..fwd_999: the user's thousand
    assert "the Monitor's step timer is not counted" in said[0]


def test_a_pause_a_log_step_ended_then_resumed_is_said_once_as_the_evaluation_between_counts(caplog, clock):
    """``monitor.pause()`` before ``monitor.step()`` at a log step (a Trainer callback's order), then an
    evaluation and ``resume()``: the log step ends the pause, so the evaluation counts as step time,
    without a word (11x the step time here). The resume() that ends no pause says so, once; pause()
    after monitor.step() leaves the evaluation out, and an evaluation before monitor.step(), its pause
    never resumed, is left out too (the log step ends it where it should), both without a word."""
    import distmetrics as dm

    caplog.set_level(logging.WARNING, logger="distmetrics")
    for order in ("pause, step, eval, resume", "step, pause, eval, resume", "pause, eval, step",
                  "resume, pause, eval, step"):  # the last: resume() at the top of every step, at once
        caplog.clear()
        with dm.Monitor(quiet_config(log_interval=2, timing_log_level=0, log_throughput=True)) as monitor:
            for step in range(1, 9):
                if order == "resume, pause, eval, step":
                    monitor.resume()
                clock.advance(100.0)
                if step % 4 == 0 and order != "step, pause, eval, resume":
                    monitor.pause()
                    if order in ("pause, eval, step", "resume, pause, eval, step"):
                        clock.advance(2000.0)
                metrics = monitor.step(step, loss=1.0, tokens=10)
                if step % 4 == 0 and order[-4:] != "step":  # a 2 s evaluation after the log steps 4 and 8
                    if order == "step, pause, eval, resume":
                        monitor.pause()
                    clock.advance(2000.0)
                    monitor.resume()
                if step in (4, 6):
                    record = metrics
        said = [r.getMessage() for r in caplog.records if "ended no pause" in r.getMessage()]
        if order == "pause, step, eval, resume":
            assert record["train/step_time_ms"] == pytest.approx(1100.0) and len(said) == 1, said
            assert said[0].startswith("distmetrics: monitor.resume() after the log step of step 4 ended no pause: ")
        else:
            assert record["train/step_time_ms"] == pytest.approx(100.0) and said == [], (order, said)


def test_steps_made_in_a_pause_never_resumed_are_said_once(caplog, clock):
    """pause() after step 5 and no resume(): steps 6 to 8 were counted with no time (timers/step 2.7 ms
    for 10, tokens/s twice the truth) without a word. A second monitor.step in one pause says so, once;
    one monitor.step in a pause (an evaluation before it, the pause ended by the step) says nothing."""
    import distmetrics as dm

    caplog.set_level(logging.WARNING, logger="distmetrics")
    with dm.Monitor(quiet_config(log_interval=4, timing_log_level=0)) as monitor:
        for step in range(1, 13):
            clock.advance(10.0)
            if step in (3, 11):  # a pause over one monitor.step, resumed after it
                monitor.pause()
                clock.advance(50.0)
            metrics = monitor.step(step, loss=1.0, tokens=100)
            if step in (3, 11):
                monitor.resume()
            if step == 5:
                monitor.pause()
            if step == 8:
                record = metrics
    said = [r.getMessage() for r in caplog.records if "came twice in one pause" in r.getMessage()]
    assert len(said) == 1 and "monitor.resume()" in said[0], said
    assert record["timers/step"] < 10.0  # as the README says: a pause lasts to the log step


def test_a_step_timer_paused_at_the_log_step_is_read_once_and_kept_once():
    """``monitor.pause()`` before ``monitor.step`` (an evaluation at the end of the loop body, resumed
    by the log step): the log step's resume of the step timer noted it among the timers in use while
    that list was read, one more entry at every such log step, for the rest of the run."""
    import time

    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=2, timing_log_level=1, log_throughput=False)) as monitor:
        for step in range(1, 21):
            time.sleep(0.001)
            monitor.pause()
            if monitor.step(step):
                assert [t.name for t in monitor.timers.in_use] == ["step"], step


def test_a_report_given_one_name_as_text_or_a_normalizer_that_is_no_number_is_refused_naming_it():
    """``timers.log("fwd")`` read the text as the names "f", "w" and "d" (nothing reported, no
    word), and ``normalizer="x"`` raised a bare TypeError; both are TimerErrors naming the value,
    raised before the report's collective."""
    import torch

    from distmetrics.collectors.timers import TimerError, Timers

    timers = Timers(log_level=2)
    timers("fwd", log_level=0).start()
    for report in (timers.get_all_timers_string, timers.log, lambda n, **k: timers.write(n, None, 1, **k)):
        with pytest.raises(TimerError, match=r"names='fwd': accepted values are a list of timer names, e.g. \['fwd'\]"):
            report("fwd")
        for normalizer in ("x", None, True, 0, float("nan")):
            with pytest.raises(TimerError, match=f"normalizer={normalizer!r}: accepted values are numbers > 0"):
                report(["fwd"], normalizer=normalizer)
        report(["fwd"], normalizer=torch.tensor(2.0))  # a 0-d tensor passes, as Megatron's assert takes it
    # a tensor of shape [1] passed the check, then the text could not be formatted: the times read and lost
    timers = Timers(log_level=2)
    timers("fwd", log_level=0).start()
    timers("fwd").stop()
    assert "fwd" in timers.get_all_timers_string(["fwd"], normalizer=torch.tensor([2.0]))
