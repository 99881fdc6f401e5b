"""Straggler scores: the maths against a hand computation, then 4 real gloo ranks with known
step and timer times (the slowest rank named, its score against the truth, the record, the
alert, the collectives counted). The times are a :class:`~tests.dist_utils.FakeClock`'s that
each rank advances by its planned milliseconds, read by the library's step, timer and straggler
clocks in place of ``time.perf_counter``, so every score is an exact hand computation. NVML
cannot exist here: its scenario uses the fake ``pynvml`` module (tests/fake_pynvml.py),
installed in ``sys.modules`` at the import boundary of each rank."""

import math
import socket
import statistics
import sys

import pytest
import torch

import distmetrics as dm
from distmetrics.collectors.stragglers import (fastest_ranks, relative_scores, slowest_ranks, window_medians,
                                               window_scores)
from tests import fake_pynvml
from tests.dist_utils import CollectiveCounter, FakeClock, quiet_config, run_ranks

WORLD = 4
INTERVAL = 2
LOG_STEPS = 6
WINDOW = 3
DATA_MS = [8, 16, 8, 8]        # rank 1 loads data slowly
COMPUTE_MS = [40, 40, 60, 40]  # rank 2 computes slowly


# --- the maths ------------------------------------------------------------------------------

def _window(rows):
    return [torch.tensor(r, dtype=torch.float64) for r in rows]


def test_score_is_the_fastest_median_over_the_ranks_own():
    rows = [[10.0, 20.0, 12.0, 40.0], [10.0, 22.0, 12.0, 41.0], [11.0, 20.0, 13.0, 39.0], [12.0, 21.0, 12.5, 40.0]]
    medians = [statistics.median(col) for col in zip(*rows)]  # even count: the mean of the middle two
    assert window_medians(_window(rows)).tolist() == pytest.approx(medians)
    truth = [min(medians) / m for m in medians]
    scores = window_scores(_window(rows))
    assert scores.tolist() == pytest.approx(truth)
    assert slowest_ranks(scores, 2) == [3, 1]
    assert fastest_ranks(scores, 2) == [0, 2]


def test_one_slow_interval_counts_for_little():
    rows = [[100.0] * 4 for _ in range(9)]
    rows[4] = [100.0, 900.0, 100.0, 100.0]  # a checkpoint on rank 1, once
    assert window_scores(_window(rows)).tolist() == pytest.approx([1.0] * 4)


def test_ranks_without_a_value_score_nan_and_are_never_named():
    rows = [[10.0, math.nan, 0.0, 20.0], [math.inf, math.nan, -1.0, 20.0], [10.0, math.nan, 5.0, 20.0]]
    scores = window_scores(_window(rows))
    assert math.isnan(scores[1])
    assert scores[[0, 2, 3]].tolist() == pytest.approx([0.5, 1.0, 0.25])
    assert 1 not in slowest_ranks(scores, 10) and 1 not in fastest_ranks(scores, 10)
    assert len(slowest_ranks(scores, 10)) == 3
    assert torch.isnan(relative_scores(torch.tensor([math.nan, 0.0], dtype=torch.float64))).all()


def test_ties_keep_rank_order():
    scores = torch.tensor([0.5, 1.0, 0.5, 1.0], dtype=torch.float64)
    assert slowest_ranks(scores, 2) == [0, 2] and fastest_ranks(scores, 2) == [1, 3]
    assert slowest_ranks(scores, 0) == [] and len(slowest_ranks(scores, 100)) == 4


def test_paused_time_is_left_out_of_a_ranks_step_time():
    """``monitor.pause()`` (evaluation, a checkpoint) reaches the scores' clock too (a
    :class:`FakeClock` in place of ``time.perf_counter``)."""
    from distmetrics.collectors.stragglers import STEP_MS, StragglerCollector

    class Recorded(StragglerCollector):
        def take_samples(self, ctx):
            samples = super().take_samples(ctx)
            self.step_ms = next(s.value for s in samples if s.name == STEP_MS)
            return samples

    with FakeClock() as clock:
        collector = Recorded(window=2)
        monitor = dm.Monitor(quiet_config(log_interval=1, straggler_window=0), collectors=[collector])
        monitor.step(1)  # a log step: the clock starts again after it
        clock.advance(20.0)
        monitor.pause()
        clock.advance(300.0)  # an evaluation
        monitor.resume()
        monitor.step(2)
        monitor.close()
    assert collector.step_ms == pytest.approx(20.0)  # not 320 ms


def test_the_first_interval_counts_only_the_steps_its_clock_measured():
    """The clock starts at the first ``monitor.step``, so that step's own time is not in the
    first interval: its milliseconds per step are over the steps after it (a :class:`FakeClock`
    in place of ``time.perf_counter``); with ``log_interval: 1`` the first log step measured no
    step and sends no time (NaN, left out of the scores)."""
    import math

    from distmetrics.collectors.stragglers import STEP_MS, StragglerCollector

    class Recorded(StragglerCollector):
        def take_samples(self, ctx):
            samples = super().take_samples(ctx)
            self.step_ms.append(next(s.value for s in samples if s.name == STEP_MS))
            return samples

    for interval, expected in ((2, [10.0, 10.0]), (1, [math.nan, 10.0, 10.0, 10.0])):
        with FakeClock() as clock:
            collector = Recorded(window=2)
            collector.step_ms = []
            monitor = dm.Monitor(quiet_config(log_interval=interval, straggler_window=0), collectors=[collector])
            for step in range(1, 5):
                monitor.step(step)
                clock.advance(10.0)
            monitor.close()
        assert collector.step_ms[:len(expected)] == pytest.approx(expected, nan_ok=True), interval


def test_one_rank_keeps_no_straggler_scores_and_sends_no_timer_lanes_for_them(tmp_path):
    """Scores compare ranks: a job of one rank has none to compare (its score would be 1.0 at
    every log step), so it keeps no windows, writes no ``stragglers/score_min`` and no
    ``stragglers`` record, its timers send no per-rank lanes, and they name no slowest rank."""
    import distmetrics as dm

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, straggler_window=2, straggler_report_every=1,
                           console=False, tensorboard=False, timing_log_option="minmax", timing_log_level=2)
    monitor = dm.Monitor(cfg)
    assert "stragglers" not in {c.name for c in monitor.collectors} and not monitor._by_name["timers"].per_rank
    for step in range(1, 5):
        with monitor.timers("data", log_level=0):
            pass
        metrics = monitor.step(step, loss=1.0)
    monitor.close()
    assert "timers/data" in metrics and not any(k.startswith("stragglers/") for k in metrics), sorted(metrics)
    kinds = {r["kind"] for r in dm.read_jsonl(tmp_path / "metrics.jsonl")}
    assert "train" in kinds and "stragglers" not in kinds


ONE_RANK_MS = 5.0  # the timer's milliseconds per step in the one-rank job
ONE_RANK_TOTAL = 3  # its total_steps; it runs 5


def _one_rank_job(rank: int, world: int, out_dir: str) -> dict:
    """A gloo job of one rank under each ``timing_log_option``, 5 steps against ``total_steps=3``:
    its JSONL records and console lines (a handler on the console's logger, which the sink prints
    through in place of stdout)."""
    import logging

    import distmetrics as dm

    out = {}
    for option in ("minmax", "all", "max"):
        lines: list = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append((record.levelno, record.getMessage()))
        logging.getLogger("distmetrics.console").addHandler(handler)
        try:
            with FakeClock() as clock:
                monitor = dm.Monitor(quiet_config(output_dir=f"{out_dir}/{option}", json_log=True, console=True,
                                                  log_interval=1, timing_log_level=1, timing_log_option=option,
                                                  log_throughput=True, straggler_window=2,
                                                  total_steps=ONE_RANK_TOTAL))
                for step in range(1, 6):
                    with monitor.timers("data", log_level=1):
                        clock.advance(ONE_RANK_MS)
                    monitor.step(step, loss=1.0)
                monitor.close()
        finally:
            logging.getLogger("distmetrics.console").removeHandler(handler)
        out[option] = {"records": [r for r in dm.read_jsonl(f"{out_dir}/{option}/metrics.jsonl")
                                   if r["kind"] == "train"], "lines": lines}
    return out


def test_a_one_rank_job_names_no_straggler_and_its_console_goes_past_total_steps_without_a_fraction(tmp_path):
    """With one rank, ``stragglers/<timer>/rank``, ``/host``, ``/local_rank`` and ``/max_over_mean``
    (always 1.0) were written at every log step, naming the job's only rank. Past ``total_steps``
    the console printed ``step 4/3 [133.3%]`` with ``eta 0s``; now the step alone after one
    warning, and no ETA. The timer block is Megatron's text for each option (a job of one rank
    prints it too, as Megatron's ``Timers.log`` does): ``(min, max)`` under ``minmax`` and under
    ``all`` (the fastest and slowest of every rank's values), ``max`` alone under ``max``."""
    runs = run_ranks(_one_rank_job, 1, str(tmp_path), timeout=120)[0]
    label = "data ".ljust(48, ".")
    blocks = {"minmax": ("(min, max) time across ranks (ms):", f"    {label}: ({ONE_RANK_MS:.2f}, {ONE_RANK_MS:.2f})"),
              "all": ("(min, max) time across ranks (ms):", f"    {label}: ({ONE_RANK_MS:.2f}, {ONE_RANK_MS:.2f})"),
              "max": ("max time across ranks (ms):", f"    {label}: {ONE_RANK_MS:.2f}")}
    for option, run in runs.items():
        records = run["records"]
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5], option
        for record in records:
            assert record["timers/data" if option != "all" else "timers/data/rank0"] == pytest.approx(ONE_RANK_MS)
            assert not [k for k in record if k.startswith("stragglers/")], (option, sorted(record))
        # ETA: the steps left at 5 ms each (step 1 has no timed step), none past total_steps
        assert [r.get("train/eta_s") for r in records] == [None, pytest.approx(0.005), 0.0, None, None], option
        trains = [text for level, text in run["lines"] if text.startswith(":: step")]
        fraction = [f"/{ONE_RANK_TOTAL} [{100.0 * s / ONE_RANK_TOTAL:4.1f}%]" for s in (1, 2, 3)] + ["", ""]
        trends = ["", " =", " =", " =", " ="]  # the loss stays 1.0 (blank on the first line)
        want = [f":: step {s}{f}{t}" for s, f, t in zip(range(1, 6), fraction, trends)]
        assert [t.split(" loss")[0].rstrip() for t in trains] == want, (option, trains)
        assert "eta 0s" in trains[2] and not any("eta " in t for t in trains[3:]), (option, trains)
        past = [text for level, text in run["lines"] if "past total_steps" in text]
        assert len(past) == 1 and "step 4" in past[0], (option, run["lines"])
        timer_blocks = [text for level, text in run["lines"] if "time across ranks" in text]
        assert len(timer_blocks) == 5, (option, run["lines"])
        head, line = blocks[option]  # the step timer's line comes first from step 2 on (made first)
        assert all(b.splitlines()[0] == head and b.splitlines()[-1] == line for b in timer_blocks), \
            (option, timer_blocks)


def test_one_console_line_per_straggler_and_again_only_after_it_recovered(caplog):
    """The collector's alert logic on given per-rank step times (as the gather hands them over),
    through the console sink."""
    import logging
    import types

    from distmetrics.collectors.base import LogContext
    from distmetrics.collectors.stragglers import STEP_MS, StragglerCollector
    from distmetrics.sinks.console import LOGGER_NAME, ConsoleSink

    hosts = [types.SimpleNamespace(hostname=f"node-{r}", local_rank=r % 2) for r in range(4)]
    collector = StragglerCollector(window=3, report_every=0, threshold=0.8)
    console = ConsoleSink()
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    slow, fast = [10.0, 10.5, 20.0, 10.0], [10.0, 10.5, 10.0, 10.0]
    for step, times in enumerate([slow, slow, slow, slow, fast, slow, slow, slow], start=1):
        for alert in collector.finalize({STEP_MS: dm.PerRank(times)}, LogContext(step, 1, None, hosts)):
            console.log(alert.to_record(), step, alert.kind)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("!!")]
    assert lines == [
        "!! step 3: straggler: rank 2 (node-2, local rank 0, score at most 0.50) below 0.8 of the fastest rank's speed "
        "at each of the last 3 log steps",
        "!! step 8: straggler: rank 2 (node-2, local rank 0, score at most 0.50) below 0.8 of the fastest rank's speed "
        "at each of the last 3 log steps"]


def test_a_straggler_window_above_the_bound_is_refused_naming_the_key_value_and_range():
    """Every log step takes each series' median over the whole window again, at a cost that grows with
    the window: tens of milliseconds a log step at a window of 1,000 on 32 ranks, and there was no bound."""
    with pytest.raises(dm.ConfigError, match=r"straggler_window=101: accepted values are integers from 0 \(off\) "
                                             r"to 100"):
        dm.MetricsConfig(straggler_window=101)
    assert dm.MetricsConfig(straggler_window=100).straggler_window == 100


def test_a_world_size_change_forgets_the_old_worlds_alerts():
    """The windows start over at another world size; the alerted ranks, places in the old world,
    were kept, so the new world's rank 1, slow from its first log step, was never alerted."""
    from distmetrics.collectors.base import Alert, LogContext
    from distmetrics.collectors.stragglers import STEP_MS, StragglerCollector

    collector = StragglerCollector(window=1, report_every=0, threshold=0.9)
    ctx = LogContext(step=1, steps=1, layout=None)
    alerted = []
    for times in ([10.0, 20.0], [10.0, 20.0, 10.0], [10.0, 20.0, 10.0]):
        alerted += [a.details["ranks"] for a in collector.finalize({STEP_MS: dm.PerRank(times)}, ctx)
                    if isinstance(a, Alert)]
    assert alerted == [[1], [1]]  # once per world: the new world's rank 1 is new


@pytest.mark.parametrize("key,value", [("straggler_window", -1), ("straggler_report_every", -2),
                                       ("straggler_report_ranks", 0), ("straggler_threshold", 1.5),
                                       ("straggler_threshold", 0.0)])
def test_impossible_straggler_settings_name_the_key(key, value):
    with pytest.raises(dm.ConfigError, match=key):
        dm.MetricsConfig(**{key: value})


# --- 4 real ranks ---------------------------------------------------------------------------

class _RankTimes:
    """Every rank's value of a timer as a timer collector sends it under max/minmax:
    ``_ranks/timers/<name>`` lanes of the ALL pack (rank r: 10·(r+1) ms)."""

    name = "rank_times"
    after = ()

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def take_samples(self, ctx):
        return [dm.Sample("_ranks/timers/load", 10.0 * (self.rank + 1), "all")]

    def finalize(self, metrics, ctx):
        return []

    def close(self):
        pass


# it stands in for the timers collector, whose internal lanes start with '_' (refused from a user's collector)
_RankTimes.__module__ = "distmetrics.collectors.timers"


def _known_times(rank: int, out_dir: str) -> dict:
    cfg = quiet_config(log_interval=INTERVAL, json_log=True, output_dir=out_dir, timing_log_level=1,
                       timing_log_option="all", straggler_window=WINDOW, straggler_report_every=WINDOW,
                       straggler_report_ranks=2, straggler_threshold=0.8)
    with FakeClock() as clock:
        monitor = dm.Monitor(cfg)
        non_log, last = [], None
        for step in range(1, INTERVAL * LOG_STEPS + 1):
            with CollectiveCounter() as counter:
                with monitor.timers("data", log_level=1):
                    clock.advance(DATA_MS[rank])
                with monitor.timers("compute", log_level=1):
                    clock.advance(COMPUTE_MS[rank])
                metrics = monitor.step(step)
            if metrics is None:
                non_log.append(counter.collectives)
            else:
                last = {k: v for k, v in metrics.items() if k.startswith(("stragglers/", "_"))}
        monitor.close()
    return {"non_log": non_log, "last": last}


def _collectives_at_a_log_step(option: str, stragglers: bool) -> int:
    monitor = dm.Monitor(quiet_config(log_interval=1, timing_log_level=0, timing_log_option=option,
                                      straggler_window=3 if stragglers else 0))
    monitor.step(1)
    monitor.step(2)  # the step timer's first value: its name joins the layout here
    with CollectiveCounter() as counter:
        monitor.step(3)
    monitor.close()
    return counter.collectives


def _nvml_and_rank_lanes(rank: int, out_dir: str) -> dict:
    from distmetrics.collectors.stragglers import StragglerCollector

    sys.modules["pynvml"] = fake_pynvml.make(devices={f"GPU-{r}": [0] for r in range(WORLD)})
    cfg = quiet_config(log_interval=1, json_log=True, output_dir=out_dir, timing_log_level=0,
                       timing_log_option="minmax", straggler_window=0)
    collectors = [StragglerCollector(window=2, report_every=1, report_ranks=WORLD, nvml=True, uuid=f"GPU-{rank}"),
                  _RankTimes(rank)]
    monitor = dm.Monitor(cfg, collectors=collectors)
    metrics = [monitor.step(step) for step in (1, 2)]
    monitor.close()
    return {k: v for k, v in metrics[-1].items() if k.startswith(("stragglers/load", "_"))}


def _minmax_timers(rank: int) -> dict:
    """Real timers under minmax: rank 2's "data" timer runs 40 ms per step, the others' 10 ms."""
    cfg = quiet_config(log_interval=2, timing_log_level=1, timing_log_option="minmax", straggler_window=2)
    with FakeClock() as clock:
        monitor = dm.Monitor(cfg)
        metrics = None
        for step in (1, 2, 3, 4):
            with monitor.timers("data", log_level=1):
                clock.advance(40.0 if rank == 2 else 10.0)
            metrics = monitor.step(step) or metrics
        monitor.close()
    return {k: v for k, v in metrics.items() if k.startswith(("stragglers/data", "_ranks"))}


def _turn_ms(rank: int, step: int) -> float:
    """Rank 0 takes 100 ms every step; ranks 1-3 take 85 ms in turn, 110 ms otherwise."""
    return 100.0 if rank == 0 else 85.0 if step % 3 == rank - 1 else 110.0


def _turns(rank: int, out_dir: str) -> None:
    """log_interval 1, a window of 3: rank 0 is below 0.9 of the fastest (85/100) at every log step,
    yet its window median (100) is the lowest: its median score is 1.0."""
    cfg = quiet_config(log_interval=1, json_log=True, output_dir=out_dir, timing_log_level=-1, straggler_window=3,
                       straggler_report_every=1, straggler_report_ranks=WORLD, straggler_threshold=0.9)
    with FakeClock() as clock:
        with dm.Monitor(cfg) as monitor:
            for step in range(1, 8):
                clock.advance(_turn_ms(rank, step))  # step 1's own time comes before the clock starts
                monitor.step(step)


def _equal_steps(rank: int, out_dir: str) -> dict:
    """Every rank 66 ms a step, each rank's clock reading a different time (as ranks that started apart)."""
    cfg = quiet_config(log_interval=2, json_log=True, output_dir=out_dir, timing_log_level=0,
                       timing_log_option="all", straggler_window=2, straggler_report_every=2, straggler_threshold=1.0)
    metrics = None
    with FakeClock(start_s=100.0 + 0.0371 * rank) as clock:
        with dm.Monitor(cfg) as monitor:
            for step in range(1, 9):
                clock.advance(66.0)
                metrics = monitor.step(step) or metrics
    return {k: list(v) if isinstance(v, list) else v for k, v in metrics.items()
            if k.startswith(("stragglers/", "timers/step"))}


def _sometimes(rank: int) -> list:
    """An "eval" timer run in the first and third intervals only (rank 3 takes 30 ms, the others 10 ms)."""
    cfg = quiet_config(log_interval=2, timing_log_level=1, timing_log_option="minmax", straggler_window=3)
    scores = []
    with FakeClock() as clock:
        with dm.Monitor(cfg) as monitor:
            for step in range(1, 7):
                if step in (1, 5):
                    with monitor.timers("eval", log_level=1):
                        clock.advance(30.0 if rank == 3 else 10.0)
                metrics = monitor.step(step)
                if metrics is not None:
                    scores.append({k: v for k, v in metrics.items() if k.startswith("stragglers/eval/score_min")})
    return scores


def _scenarios(rank: int, world: int, out_dir: str) -> dict:
    out = {"known": _known_times(rank, f"{out_dir}/known"), "minmax_timers": _minmax_timers(rank),
           "sometimes": _sometimes(rank)}
    _turns(rank, f"{out_dir}/turns")
    out["equal"] = _equal_steps(rank, f"{out_dir}/equal")
    out["counts"] = {(option, on): _collectives_at_a_log_step(option, on)
                     for option in ("minmax", "all") for on in (False, True)}
    out["nvml"] = _nvml_and_rank_lanes(rank, f"{out_dir}/nvml")
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("stragglers")
    return run_ranks(_scenarios, WORLD, str(out), timeout=240), out


def test_the_slowest_rank_is_named_with_its_score_host_and_local_rank(four_ranks):
    results, _ = four_ranks
    last = results[0]["known"]["last"]
    step_ms = [d + c for d, c in zip(DATA_MS, COMPUTE_MS)]
    truth = min(step_ms) / step_ms[2]  # 48 / 68
    assert last["stragglers/score_min_rank"] == 2
    assert last["stragglers/score_min"] == pytest.approx(truth)
    assert last["stragglers/score_min_host"] == socket.gethostname()
    assert last["stragglers/score_min_local_rank"] == 2  # LOCAL_RANK = rank in these workers
    assert all(r["known"]["last"] == last for r in results)  # the same on every rank
    assert not any(k.startswith("_") for k in last)  # internal lanes never reach the metrics


def test_a_timer_absent_from_a_log_step_has_no_score_there_and_keeps_its_window(four_ranks):
    """As the README says: per timer reported at that log step; its window keeps the values of the log steps
    that reported it (rank 3's median 30 ms against 10 ms at the third log step, over two values)."""
    first, second, third = four_ranks[0][0]["sometimes"]
    assert first == third == {"stragglers/eval/score_min": pytest.approx(1 / 3), "stragglers/eval/score_min_rank": 3}
    assert second == {}


def test_per_timer_scores_name_a_slow_input_pipeline_apart_from_slow_compute(four_ranks):
    last = four_ranks[0][0]["known"]["last"]
    assert last["stragglers/data/score_min_rank"] == 1
    assert last["stragglers/data/score_min"] == pytest.approx(min(DATA_MS) / DATA_MS[1])
    assert last["stragglers/compute/score_min_rank"] == 2
    assert last["stragglers/compute/score_min"] == pytest.approx(min(COMPUTE_MS) / COMPUTE_MS[2])


def test_stragglers_record_lists_the_slowest_and_fastest_ranks(four_ranks):
    records = list(dm.read_jsonl(four_ranks[1] / "known" / "metrics.jsonl"))
    reports = [r for r in records if r["kind"] == "stragglers"]
    assert [r["step"] for r in reports] == [INTERVAL * WINDOW, INTERVAL * 2 * WINDOW]  # every WINDOW log steps
    report = reports[-1]
    assert report["window"] == WINDOW and report["threshold"] == 0.8
    assert [row["rank"] for row in report["slowest"]] == [2, 1]
    assert {row["rank"] for row in report["fastest"]} <= {0, 3} and len(report["fastest"]) == 2
    slowest = report["slowest"][0]
    assert slowest["host"] == socket.gethostname() and slowest["local_rank"] == 2
    assert slowest["ms"] == pytest.approx(DATA_MS[2] + COMPUTE_MS[2])
    assert report["timers"]["data"][0]["rank"] == 1 and report["timers"]["compute"][0]["rank"] == 2


def test_a_rank_below_the_threshold_for_a_whole_window_is_alerted_once(four_ranks):
    records = list(dm.read_jsonl(four_ranks[1] / "known" / "metrics.jsonl"))
    alerts = [r for r in records if r["kind"] == "alert" and r["alert"] == "straggler"]
    assert len(alerts) == 1, alerts  # rank 1 (score 48/56 = 0.86) stays above 0.8; rank 2 once, not every step
    assert alerts[0]["step"] == INTERVAL * WINDOW and alerts[0]["ranks"] == [2]
    assert "rank 2 (" in alerts[0]["message"] and socket.gethostname() in alerts[0]["message"]


def test_the_alert_gives_the_interval_scores_that_decided_it_not_the_window_median(four_ranks):
    """Rank 0 is alerted (85/100 at each of the last 3 log steps, by hand) while its window median
    score is 1.0: the line said "score 1.00 ... below 0.9" and the record gave scores [1.0]."""
    records = list(dm.read_jsonl(four_ranks[1] / "turns" / "metrics.jsonl"))
    alerts = [r for r in records if r["kind"] == "alert" and r["alert"] == "straggler"]
    assert [(a["step"], a["ranks"]) for a in alerts] == [(4, [0])], alerts  # timed log steps 2, 3, 4
    assert alerts[0]["scores"] == [pytest.approx(85.0 / 100.0)]
    assert f"rank 0 ({socket.gethostname()}, local rank 0, score at most 0.85) below 0.9 " in alerts[0]["message"]
    report = next(r for r in records if r["kind"] == "stragglers" and r["step"] == 4)
    assert [row["score"] for row in report["fastest"]] == [1.0]  # its median, 100 ms, is the lowest


def test_the_stragglers_record_lists_a_rank_once_and_only_ranks_below_the_fastest_as_slowest(four_ranks):
    """With straggler_report_ranks as large as the world, every rank was listed as slowest and as
    fastest (the fastest among the slowest, at 1.0); and with log_interval 1 the first log step,
    which times no step, wrote a record with both lists empty."""
    records = list(dm.read_jsonl(four_ranks[1] / "turns" / "metrics.jsonl"))
    reports = [r for r in records if r["kind"] == "stragglers"]
    assert [r["step"] for r in reports] == list(range(2, 8))
    for report in reports:
        slowest, fastest = [row["rank"] for row in report["slowest"]], [row["rank"] for row in report["fastest"]]
        assert sorted(slowest + fastest) == list(range(WORLD)), report
        assert all(row["score"] < 1.0 for row in report["slowest"]) and report["fastest"][0]["score"] == 1.0
    medians = [statistics.median(_turn_ms(r, s) for s in (5, 6, 7)) for r in range(WORLD)]  # the last window
    assert [row["rank"] for row in reports[-1]["fastest"]] == [0] and reports[-1]["slowest"][0]["score"] == \
        pytest.approx(min(medians) / max(medians))


def test_ranks_with_equal_steps_score_exactly_one_and_none_is_below_a_threshold_of_one(four_ranks):
    """The interval clock read float seconds: each rank's clock at another reading, equal 66 ms steps
    came out 65.9999999999954 on some ranks and 66.0000000000025 on others, scored 0.9999999999999
    (the lowest named as the straggler), and under straggler_threshold 1.0 were below the fastest."""
    for result in four_ranks[0]:
        equal = result["equal"]
        assert equal["stragglers/score_min"] == 1.0 and equal["stragglers/score_min_rank"] == 0, equal
        assert equal["stragglers/step/score_min"] == 1.0 and equal["timers/step"] == [66.0] * WORLD
    records = list(dm.read_jsonl(four_ranks[1] / "equal" / "metrics.jsonl"))
    assert not [r for r in records if r["kind"] == "alert"]
    report = [r for r in records if r["kind"] == "stragglers"][-1]
    assert report["slowest"] == [] and [row["ms"] for row in report["fastest"]] == [66.0] * WORLD


def test_no_collective_between_log_steps(four_ranks):
    for result in four_ranks[0]:
        assert result["known"]["non_log"] == [0] * (LOG_STEPS * (INTERVAL - 1))


def test_step_times_ride_the_existing_gather(four_ranks):
    """Under ``all`` the timers already fill the ALL pack: no collective more. Under minmax
    there is no ALL pack without the scores: one gather more, no other."""
    counts = four_ranks[0][0]["counts"]
    assert counts[("all", True)] == counts[("all", False)]
    assert counts[("minmax", True)] == counts[("minmax", False)] + 1


def test_power_and_sm_clock_beside_the_score_with_nvml(four_ranks):
    records = list(dm.read_jsonl(four_ranks[1] / "nvml" / "metrics.jsonl"))
    report = [r for r in records if r["kind"] == "stragglers"][-1]
    rows = {row["rank"]: row for row in report["slowest"] + report["fastest"]}  # no rank in both
    assert sorted(rows) == list(range(WORLD)) and len(report["slowest"] + report["fastest"]) == WORLD
    for rank, row in rows.items():  # the fake GPU r draws 250 + 25·r W at 1500 + 10·r MHz
        assert row["power_w"] == pytest.approx(250.0 + 25.0 * rank)
        assert row["sm_clock_mhz"] == pytest.approx(1500.0 + 10.0 * rank)


def test_every_ranks_timer_lanes_under_minmax_are_scored_and_taken_out(four_ranks):
    last = four_ranks[0][0]["nvml"]
    assert last["stragglers/load/score_min_rank"] == WORLD - 1
    assert last["stragglers/load/score_min"] == pytest.approx(1.0 / WORLD)
    assert not any(k.startswith("_") for k in last)


def test_under_minmax_the_timer_collector_sends_every_ranks_timer_values_for_the_scores(four_ranks):
    results, _ = four_ranks
    scores = results[0]["minmax_timers"]
    assert scores["stragglers/data/score_min_rank"] == 2 and scores["stragglers/data/score_min"] == pytest.approx(0.25)
    assert not any(k.startswith("_ranks") for k in scores)  # the lanes are taken out


@pytest.mark.parametrize("host_world", [32, 0], ids=["lists", "tensor ring"])
def test_every_series_is_the_median_of_its_last_window_log_steps_and_a_new_timer_starts_empty(host_world,
                                                                                                monkeypatch):
    """The collector's windows against statistics.median of each series' last WINDOW log steps,
    by hand: a timer seen from the third log step on, absent at the fifth (that log step holds
    no value of it), and a world-size change that starts every window over. Both forms: the
    lists small worlds use, and the tensor ring (``_HOST_WORLD`` 0 sends every world there)."""
    from distmetrics.collectors import stragglers

    monkeypatch.setattr(stragglers, "_HOST_WORLD", host_world)
    from distmetrics.collectors.base import LogContext
    from distmetrics.collectors.stragglers import STEP_MS, StragglerCollector
    from distmetrics.reduce import PerRank

    collector = StragglerCollector(window=WINDOW, report_every=0)
    ctx = LogContext(step=1, steps=1, layout=None)
    step_rows = [[10.0, 20.0], [30.0, 10.0], [20.0, 40.0], [50.0, 10.0], [10.0, 30.0], [40.0, 20.0]]
    data_rows = [None, None, [4.0, 1.0], [2.0, 8.0], None, [6.0, 2.0]]
    for i, (step, data) in enumerate(zip(step_rows, data_rows)):
        metrics = {STEP_MS: PerRank(step)}
        if data is not None:
            metrics["_ranks/timers/data"] = PerRank(data)
        collector.finalize(metrics, ctx)
        recent = slice(max(0, i + 1 - WINDOW), i + 1)
        medians = [statistics.median(col) for col in zip(*step_rows[recent])]
        truth = min(medians) / max(medians)
        assert metrics["stragglers/score_min"] == pytest.approx(truth)
        assert metrics["stragglers/score_min_rank"] == medians.index(max(medians))
        if data is not None:
            rows = [r for r in data_rows[recent] if r is not None]
            medians = [statistics.median(col) for col in zip(*rows)]
            assert metrics["stragglers/data/score_min"] == pytest.approx(min(medians) / max(medians))
        assert "_ranks/timers/data" not in metrics
    metrics = {STEP_MS: PerRank([5.0, 10.0, 20.0])}  # three ranks now: the two-rank history is gone
    collector.finalize(metrics, ctx)
    assert metrics["stragglers/score_min"] == pytest.approx(0.25) and metrics["stragglers/score_min_rank"] == 2


def test_the_straggler_alert_reads_the_step_times_row_wherever_it_sits_in_the_ring():
    """A timer seen before the step time takes the ring's first row; the alert still judges the
    step time (rank 0 at a tenth of rank 1's speed)."""
    from distmetrics.collectors.base import Alert, LogContext
    from distmetrics.collectors.stragglers import STEP_MS, StragglerCollector
    from distmetrics.reduce import PerRank

    collector = StragglerCollector(window=1, report_every=0, threshold=0.9)
    ctx = LogContext(step=1, steps=1, layout=None)
    collector.finalize({"_ranks/timers/x": PerRank([1.0, 1.0])}, ctx)
    alerts = collector.finalize({STEP_MS: PerRank([10.0, 1.0]), "_ranks/timers/x": PerRank([1.0, 1.0])}, ctx)
    assert [a.details["ranks"] for a in alerts if isinstance(a, Alert)] == [[0]]


def test_a_score_just_below_the_threshold_is_said_below_it():
    """A score of 0.89997 was said "score at most 0.90 ... below 0.9": it takes the places it needs."""
    from distmetrics.collectors.base import LogContext
    from distmetrics.collectors.stragglers import STEP_MS, StragglerCollector
    from distmetrics.reduce import PerRank

    collector = StragglerCollector(window=1, report_every=0, threshold=0.9)
    (alert,) = collector.finalize({STEP_MS: PerRank([1.0 / 0.89997, 1.0])}, LogContext(step=1, steps=1, layout=None))
    assert "score at most 0.89997) below 0.9 " in alert.message, alert.message


@pytest.mark.parametrize("world", [1, 3, 40])
def test_the_list_windows_give_the_tensor_windows_numbers_bit_for_bit(world):
    """Small worlds are scored in Python lists, large ones in a tensor ring: the same random
    series (missing, zero, infinite and NaN values, a timer that comes late and skips log steps)
    through both give identical minima, alerts, scores, medians and rankings at every log step."""
    import random

    from distmetrics.collectors.straggler_scores import HostWindows, Windows

    rng = random.Random(world)

    def value():
        roll = rng.random()
        return None if roll < 0.05 else math.nan if roll < 0.08 else 0.0 if roll < 0.1 else math.inf \
            if roll < 0.12 else rng.choice([10.0, 20.0, 30.0]) if roll < 0.3 else rng.uniform(1, 100)

    lists, tensors = HostWindows(4, world), Windows(4, world)
    for step in range(12):
        series = {"": [value() for _ in range(world)]}
        if step >= 3 and step % 4 != 1:
            series["data"] = [value() for _ in range(world)]
        for windows in (lists, tensors):
            windows.push(series)
        names = list(series)
        assert lists.slowest(names) == tensors.slowest(names)
        assert lists.stuck(0.5, 3) == tensors.stuck(0.5, 3)
        assert [lists.highest_below(r) for r in range(world)] == [tensors.highest_below(r) for r in range(world)]
        for name in names:
            for rank in range(world):
                for a, b in ((lists.score(name, rank), tensors.score(name, rank)),
                             (lists.median(name, rank), tensors.median(name, rank))):
                    assert a == b or (math.isnan(a) and math.isnan(b))
            for slowest in (True, False):
                assert lists.ranks(name, 5, slowest) == tensors.ranks(name, 5, slowest)
        assert lists.filled == tensors.filled


@pytest.mark.parametrize("world", [3, 40])
def test_a_series_absent_for_a_whole_window_is_forgotten_and_changes_no_number(world):
    """A timer named once per step by mistake (f"fwd_{step}"), or once per checkpoint: every series
    ever seen was kept, a NaN column added to every row of the window and its median taken at every
    log step for the rest of the run (30 ms a log step on 2 ranks after 5,000 names). A series absent
    for a whole window (all NaN there) is dropped; the others' numbers are those of windows that never
    saw it, bit for bit, and one that comes back starts with an empty window, as a new one does."""
    import random

    from distmetrics.collectors.straggler_scores import HostWindows, Windows

    rng = random.Random(world)
    for kind in (HostWindows, Windows):
        seeing, plain = kind(4, world), kind(4, world)
        for step in range(40):
            step_times = {"": [rng.uniform(1, 100) for _ in range(world)]}
            seeing.push({**step_times, f"fwd_{step}": [rng.uniform(1, 100) for _ in range(world)]})
            plain.push(step_times)
            for rank in range(world):
                assert seeing.score("", rank) == plain.score("", rank)
                assert seeing.median("", rank) == plain.median("", rank)
            assert seeing.slowest([""]) == plain.slowest([""])
        assert sorted(seeing.index) == ["", "fwd_36", "fwd_37", "fwd_38", "fwd_39"], kind  # the window's 4
        seeing.push({"": [1.0] * world, "fwd_0": [2.0] * world})  # back after 40 log steps: a new series
        assert seeing.median("fwd_0", 0) == 2.0

def _local_ranks_without_torchrun(rank: int, world: int) -> dict:
    import os

    import distmetrics as dm

    out = {}
    for launcher in ("none", "srun", "inherited"):
        for name in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
            os.environ.pop(name, None)
        if launcher == "srun":
            os.environ["SLURM_LOCALID"] = str(world - 1 - rank)  # srun's numbering, not the global rank's order
        if launcher == "inherited":  # one srun task that spawned its ranks: each inherits SLURM_LOCALID=0
            os.environ["SLURM_LOCALID"] = "0"
        with dm.Monitor(quiet_config(log_interval=1)) as monitor:
            out[launcher] = [h.local_rank for h in monitor.hosts]
    return out


def test_local_ranks_come_from_the_launcher_or_the_ranks_on_the_host():
    """Launched by srun or mpirun (no LOCAL_RANK), every rank was named local rank 0 in straggler
    reports: SLURM_LOCALID (and Open MPI's, MPICH's) are read, and without any, a rank's place
    among its host's ranks."""
    for out in run_ranks(_local_ranks_without_torchrun, 2, timeout=90):
        assert out == {"none": [0, 1], "srun": [1, 0], "inherited": [0, 1]}, out


def _timer_zero_on_one_rank(rank: int, world: int) -> dict:
    import distmetrics as dm

    with FakeClock() as clock:
        monitor = dm.Monitor(quiet_config(log_interval=3, timing_log_level=1, timing_log_option="minmax",
                                          straggler_window=0))
        for step in (1, 2, 3):
            with monitor.timers("x", log_level=1):
                clock.advance(5.0 if rank == 0 else 0.0)  # rank 1's timer times nothing (a stage without the work)
            with monitor.timers("y", log_level=1):
                clock.advance(10.0 / 3)  # every rank alike: 10 ms over the 3 steps
            metrics = monitor.step(step)
        monitor.close()
    return metrics


def test_a_timer_that_measured_nothing_is_left_out_of_the_minimum_and_equal_ranks_score_one():
    """Megatron-core's reports leave a rank's 0 ms out ((5.00, 5.00)); timers/x/min was 0 from
    rank 1. Every rank 10/3 ms: max_over_mean was 0.99999998 (a float32 max over a float64 mean)."""
    m = run_ranks(_timer_zero_on_one_rank, 2, timeout=90)[0]
    assert m["timers/x"] == pytest.approx(5.0) and m["timers/x/min"] == pytest.approx(5.0)
    assert m["timers/x/min_rank"] == 0
    assert m["stragglers/y/max_over_mean"] >= 1.0 and m["stragglers/y/max_over_mean"] == pytest.approx(1.0)


def test_a_gpu_reading_that_fails_once_comes_back_and_one_not_supported_is_not_asked_again(monkeypatch, caplog):
    """One NVML error on the power reading (not NOT_SUPPORTED) left the stragglers record's power out
    for the rest of the job, unsaid; the telemetry collector reads such a reading again. NVML is the
    fake module (tests/fake_pynvml.py): no GPU here."""
    from distmetrics.collectors.stragglers import POWER_W, _GpuReadings

    fake = fake_pynvml.make(devices={"GPU-0": [0]}, unsupported={"nvmlDeviceGetClockInfo"})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpu = _GpuReadings.open("GPU-0")
    assert gpu.read(1) == {POWER_W: 250.0}  # the clock is not supported: never asked again
    fake.failing["nvmlDeviceGetPowerUsage"] = 999  # NVML_ERROR_UNKNOWN
    assert gpu.read(2) == {} and gpu.read(3) == {}
    fake.failing.clear()
    assert gpu.read(4) == {POWER_W: 250.0}
    assert sum(call[0] == "nvmlDeviceGetClockInfo" for call in fake.calls) == 1
    said = [r.getMessage() for r in caplog.records if "stragglers record" in r.getMessage()]
    assert len(said) == 1 and "failed at step 2" in said[0] and "999" in said[0], said
