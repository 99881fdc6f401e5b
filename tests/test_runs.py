"""Jobs in one run folder and the clock of the first interval: a job that resumes at a step an
earlier job logged has TensorBoard drop the stale tail (read back with EventAccumulator) and says
so; throughput starts at the first ``monitor.step``, not when the Monitor is built (durations on
a :class:`~tests.dist_utils.FakeClock` the test advances by hand)."""

import logging
import math

import pytest

from tests.dist_utils import FakeClock, run_python, run_ranks


def _config(out, **extra):
    import distmetrics as dm

    return dm.MetricsConfig(output_dir=str(out), console=False, log_memory=False, **extra)


def _job(out, steps, loss, **extra):
    import distmetrics as dm

    with dm.Monitor(_config(out, log_interval=10, **extra)) as monitor:
        for step in steps:
            monitor.step(step, loss=loss, tokens=100)


def test_a_job_resuming_at_a_logged_step_purges_the_stale_tensorboard_tail_and_says_so(tmp_path, caplog):
    """Job 1 logs steps 10..40 and ends; job 2 restarts from step 20's checkpoint. TensorBoard
    then shows 10, 20 from job 1 and 30, 40 from job 2 (without the purge: 30 and 40 twice)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm

    _job(tmp_path, range(1, 41), loss=1.0)
    caplog.set_level(logging.WARNING, logger="distmetrics")
    _job(tmp_path, range(21, 41), loss=2.0)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(10, 1.0), (20, 1.0), (30, 2.0), (40, 2.0)]
    warnings = [r.getMessage() for r in caplog.records if "at or before step 40" in r.getMessage()]
    assert len(warnings) == 1 and "this job starts at step 21" in warnings[0]
    records = list(dm.read_jsonl(tmp_path / "metrics.jsonl"))
    assert [r["kind"] for r in records].count("run") == 2  # metrics.jsonl keeps both jobs
    resume = [r for r in records if r["kind"] == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == 21 and resume[0]["last_logged_step"] == 40
    starts = [line for line in (tmp_path / "progress.txt").read_text().splitlines() if line.endswith("Starting job")]
    assert len(starts) == 2  # progress.txt appends per job, as Megatron's does
    summary = run_python("-m", "distmetrics.cli", "summary", tmp_path)
    job2 = summary.stdout.split("job 2:")[1]
    assert "resumed at step 21 (step 40 was logged before; TensorBoard dropped" in job2
    assert "first step 30: loss=2" in job2


def test_the_summary_of_a_resume_without_tensorboard_says_nothing_of_tensorboard(tmp_path, capsys):
    """The summary said TensorBoard dropped the earlier job's events where TensorBoard was off."""
    from distmetrics import cli

    _job(tmp_path, range(1, 41), loss=1.0, tensorboard=False)
    _job(tmp_path, range(21, 41), loss=2.0, tensorboard=False)
    capsys.readouterr()
    assert cli.main(["summary", str(tmp_path)]) == 0
    job2 = capsys.readouterr().out.split("job 2:")[1]
    assert "resumed at step 21 (step 40 was logged before)" in job2


def test_a_resumed_job_that_evaluates_before_its_first_step_purges_after_that_evaluation(tmp_path):
    """Job 2 restarts from step 20's checkpoint and evaluates the restored model (log_eval(20))
    before its first monitor.step: its own steps start at 21, so the purge starts there and job
    1's records at step 20 stay (its train record is the only one at 20: job 2 never logs step 20;
    step 20's evaluation shows twice, once per job)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm

    for first, loss in ((1, 1.0), (21, 2.0)):
        with dm.Monitor(_config(tmp_path, log_interval=10)) as monitor:
            if first > 1:
                monitor.log_eval(first - 1, loss=1.6, tokens=10)
            for step in range(first, 41):
                monitor.step(step, loss=loss, tokens=100)
                if step % 20 == 0:
                    monitor.log_eval(step, loss=loss + 0.5, tokens=10)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("eval/loss")] == [(20, 1.5), (20, 1.6), (40, 2.5)]
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(10, 1.0), (20, 1.0), (30, 2.0), (40, 2.0)]
    resume = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "resume"]
    assert [(r["step"], r["from_step"]) for r in resume] == [(21, 21)]
    summary = run_python("-m", "distmetrics.cli", "summary", tmp_path).stdout
    assert "resumed at step 21 (step 40 was logged before" in summary


@pytest.mark.parametrize("then", ["steps from 21", "steps from 20 (a loop counting from 0)", "nothing (evaluation only)"])
def test_a_job_that_evaluates_a_restored_checkpoint_first_replaces_the_steps_it_trains_and_no_others(tmp_path, then,
                                                                                                      monkeypatch):
    """Job 1 trains steps 1-40 and evaluates at 20 and 40; job 2 restores step 20's checkpoint and
    evaluates it first. The purge was decided at that evaluation, from step 21: an evaluation-only
    job hid job 1's steps 21-40 for good (nothing replaced them), and a loop counting from 0
    (whose first step is 20) showed both jobs' step 20. What TensorBoard shows is worked out from
    the scenario: job 1's events below job 2's first step, and all of job 2's. The two event files
    are numbered 9 and 10 in one process: TensorBoard reads a folder's files in name order, and
    ".10" sorted before ".9", so job 2's purge came first and dropped nothing (seen in a full run)."""
    import itertools

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm

    monkeypatch.setattr("distmetrics.sinks.tensorboard._file_number", itertools.count(9))

    with dm.Monitor(_config(tmp_path, log_interval=10)) as monitor:
        for step in range(1, 41):
            monitor.step(step, loss=1.0, tokens=100)
            if step % 20 == 0:
                monitor.log_eval(step, loss=1.5 if step == 20 else 1.4, tokens=10)
    steps = {"steps from 21": range(21, 41), "steps from 20 (a loop counting from 0)": range(20, 40)}.get(then, ())
    with dm.Monitor(_config(tmp_path, log_interval=10)) as monitor:
        monitor.log_eval(20, loss=1.6, tokens=10)
        for step in steps:
            monitor.step(step, loss=2.0, tokens=100)
    first = steps[0] if steps else None
    job1_train = [(s, 1.0) for s in (10, 20, 30, 40)]
    job2_train = [(s, 2.0) for s in steps if s % 10 == 0] + ([(steps[-1], 2.0)] if steps and steps[-1] % 10 else [])
    job1_eval, job2_eval = [(20, 1.5), (40, 1.4)], [(20, 1.6)]
    kept = (lambda events: [e for e in events if first is None or e[0] < first])
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert sorted((e.step, e.value) for e in acc.Scalars("train/loss")) == sorted(kept(job1_train) + job2_train)
    assert sorted((e.step, round(e.value, 6)) for e in acc.Scalars("eval/loss")) == sorted(kept(job1_eval) + job2_eval)
    resume = [(r["step"], r["from_step"]) for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "resume"]
    assert resume == ([(first, first)] if first is not None else [])


def test_a_job_that_evaluated_and_ended_before_its_first_step_does_not_hide_the_one_before(tmp_path):
    """Job A trains 1-100; job B restores checkpoint 50, evaluates it and dies before its first
    step; job C resumes from 50. The last step logged was read as B's 50, so C purged nothing and
    TensorBoard showed A's and C's values at 60-100. B dropped nothing: A's 100 is the last shown."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm

    _job(tmp_path, range(1, 101), loss=1.0)
    with dm.Monitor(_config(tmp_path, log_interval=10)) as monitor:
        monitor.log_eval(50, loss=1.5, tokens=10)
    _job(tmp_path, range(51, 101), loss=3.0)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == \
        [(s, 1.0) for s in range(10, 60, 10)] + [(s, 3.0) for s in range(60, 110, 10)]
    resume = [(r["from_step"], r["last_logged_step"]) for r in dm.read_jsonl(tmp_path / "metrics.jsonl")
              if r["kind"] == "resume"]
    assert resume == [(51, 100)]


def test_events_before_the_first_step_beyond_those_kept_are_said_to_be_hidden(tmp_path, caplog):
    """A loop counting from 0 resumes at step 20 after evaluating checkpoint 20 on 18 datasets:
    TensorBoard's drop from 20 hides what the job wrote there before its first step, and the sink
    writes the last KEPT_BEFORE_START (16) again; the 2 older were hidden without a word."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm
    from distmetrics.sinks.tensorboard import KEPT_BEFORE_START

    _job(tmp_path, range(1, 41), loss=1.0)
    caplog.set_level(logging.WARNING, logger="distmetrics")
    evals = KEPT_BEFORE_START + 2
    with dm.Monitor(_config(tmp_path, log_interval=10)) as monitor:
        for n in range(evals):
            monitor.log_eval(20, loss=1.0 + n / 100, tokens=10)
        for step in range(20, 40):
            monitor.step(step, loss=2.0, tokens=100)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    shown = [round(e.value, 6) for e in acc.Scalars("eval/loss") if e.step == 20]
    assert shown == [round(1.0 + n / 100, 6) for n in range(evals - KEPT_BEFORE_START, evals)]
    said = [r.getMessage() for r in caplog.records if "hidden by the drop" in r.getMessage()]
    assert len(said) == 1 and "up to 2 earlier ones (steps 20-20)" in said[0], said


def test_an_evaluation_numbered_ahead_of_the_last_step_counts_as_logged(tmp_path):
    """Job 1 evaluates as step 11 after its step 10 (a loop that numbers an evaluation by the step
    to come), and close() then writes step 10's record after it. The last step logged was read as
    10 (the backward read stopped at the last train record), so job 2, evaluating checkpoint 11 and
    stepping from 11, was no restart: TensorBoard showed both jobs' evaluation at 11."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm

    with dm.Monitor(_config(tmp_path, log_interval=4)) as monitor:
        for step in range(1, 11):
            monitor.step(step, loss=1.0, tokens=100)
        monitor.log_eval(11, loss=1.8, tokens=10)
    with dm.Monitor(_config(tmp_path, log_interval=4)) as monitor:
        monitor.log_eval(11, loss=2.5, tokens=10)
        for step in range(11, 21):
            monitor.step(step, loss=2.0, tokens=100)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(11, 2.5)]
    resume = [(r["from_step"], r["last_logged_step"]) for r in dm.read_jsonl(tmp_path / "metrics.jsonl")
              if r["kind"] == "resume"]
    assert resume == [(11, 11)]


def test_the_resume_warning_says_only_what_the_sinks_on_do(tmp_path, caplog):
    """A restart with TensorBoard off was told "TensorBoard drops the earlier events"."""
    _job(tmp_path, range(1, 41), loss=1.0)
    caplog.set_level(logging.WARNING, logger="distmetrics")
    _job(tmp_path, range(21, 41), loss=2.0, tensorboard=False)
    said = [r.getMessage() for r in caplog.records if "this job starts at step 21" in r.getMessage()]
    assert len(said) == 1 and "TensorBoard" not in said[0] and "metrics.jsonl keeps both jobs' records" in said[0]


def test_without_metrics_jsonl_a_restart_is_said_not_to_be_recognised(tmp_path, caplog):
    """The last step logged is read from metrics.jsonl: with json_log off a job restarting from an
    earlier checkpoint cannot drop the earlier job's TensorBoard events, and said nothing of it."""
    _job(tmp_path, range(1, 41), loss=1.0, json_log=False)
    caplog.set_level(logging.WARNING, logger="distmetrics")
    _job(tmp_path, range(21, 41), loss=2.0, json_log=False)
    said = [r.getMessage() for r in caplog.records if "a restart from an earlier checkpoint is not recognised" in
            r.getMessage()]
    assert len(said) == 1 and str(tmp_path / "tensorboard") in said[0]


def test_a_tensorboard_dir_shared_with_another_output_dir_is_said(tmp_path, caplog):
    """A restart writing to a new output_dir and the earlier job's tensorboard_dir: TensorBoard showed
    both jobs' values at steps 21-40 without a word (metrics.jsonl, read for a restart, was the new
    folder's). A fresh job in a fresh folder, or one restarted in its own folder before it logged a
    step, is said nothing."""
    caplog.set_level(logging.WARNING, logger="distmetrics")
    _job(tmp_path / "fresh", range(1, 11), loss=1.0)
    for _ in range(2):  # a job that ended before its first log step, restarted: its own folder, no word
        _job(tmp_path / "early", [], loss=1.0)
    assert list((tmp_path / "early" / "tensorboard").iterdir())
    _job(tmp_path / "job1", range(1, 41), loss=1.0, tensorboard_dir=str(tmp_path / "tb"))
    assert not [r for r in caplog.records if "holds TensorBoard events" in r.getMessage()]
    _job(tmp_path / "job2", range(21, 41), loss=2.0, tensorboard_dir=str(tmp_path / "tb"))
    said = [r.getMessage() for r in caplog.records if "holds TensorBoard events" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path / "job2" / "metrics.jsonl") in said[0] and "shared" in said[0]


def test_a_job_continuing_after_the_last_logged_step_purges_nothing(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm

    _job(tmp_path, range(1, 21), loss=1.0)
    caplog.set_level(logging.WARNING, logger="distmetrics")
    _job(tmp_path, range(21, 31), loss=2.0)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [10, 20, 30]
    assert not [r for r in caplog.records if "at or before" in r.getMessage()]
    assert "resume" not in [r["kind"] for r in dm.read_jsonl(tmp_path / "metrics.jsonl")]


def test_the_first_interval_starts_at_the_first_step(tmp_path):
    """One second passes between building the Monitor and the first step (W&B's start-up, a data
    loader's, a checkpoint load); steps take 20 ms. Without the fix the first interval's step
    time is 220 ms (1100 ms over 5 steps). The durations are a :class:`FakeClock`'s, read by the
    step clock in place of ``time.perf_counter``."""
    import distmetrics as dm

    with FakeClock() as clock, dm.Monitor(_config(tmp_path, log_interval=5, tensorboard=False)) as monitor:
        clock.advance(1000.0)
        for step in range(1, 6):
            clock.advance(20.0)
            metrics = monitor.step(step, tokens=100)
    assert metrics["train/step_time_ms"] == pytest.approx(20.0)
    # steps 2..5 were timed (80 ms), with their 400 tokens; step 1's 100 tokens count as consumed
    assert metrics["train/tokens_per_sec"] == pytest.approx(400 / 0.080)
    assert metrics["train/consumed_tokens"] == 500


def test_a_restart_reading_back_its_files_leaves_the_read_out_of_the_first_step_time(tmp_path, monkeypatch):
    """A job restarted from a checkpoint reads metrics.jsonl back at its first step to find the
    checkpoint's record (a long file, long to read). The clocks started before that read, so the
    first record's step time, tokens/s and MFU counted it while timers/step did not (580 ms
    against 3 ms on a 500 MiB file). Here the read takes 1000 ms of a :class:`FakeClock` (the
    read itself is real); steps take 20 ms."""
    import distmetrics as dm
    from distmetrics import checkpoints

    with FakeClock() as clock, dm.Monitor(_config(tmp_path, log_interval=5, tensorboard=False)) as monitor:
        for step in range(1, 11):
            clock.advance(20.0)
            monitor.step(step, tokens=100)
        monitor.checkpoint_saved(10)
    read = checkpoints.CheckpointLog._record_up_to

    def slow_read(self, *args):
        clock.advance(1000.0)
        return read(self, *args)

    monkeypatch.setattr(checkpoints.CheckpointLog, "_record_up_to", slow_read)
    with FakeClock() as clock, dm.Monitor(_config(tmp_path, log_interval=5, tensorboard=False)) as monitor:
        for step in range(11, 16):
            clock.advance(20.0)
            metrics = monitor.step(step, tokens=100)
    assert metrics["train/step_time_ms"] == pytest.approx(20.0)
    assert metrics["train/tokens_per_sec"] == pytest.approx(400 / 0.080)


STEP_MS = [10.0, 20.0]  # each rank's milliseconds per step on its fake clock


def _token_accounting(rank: int, world: int, root: str) -> dict:
    import distmetrics as dm

    out = {}
    for interval in (5, 1):
        cfg = _config(f"{root}/i{interval}", log_interval=interval, tensorboard=False, json_log=False)
        with FakeClock() as clock, dm.Monitor(cfg) as monitor:
            records = []
            for step in range(1, 6):
                clock.advance(STEP_MS[rank])
                # the first step is 100× larger: its tokens must not enter the measured rate
                m = monitor.step(step, tokens=1000 * (rank + 1) if step == 1 else 10)
                if m is not None:
                    records.append({k: v for k, v in m.items() if k.startswith("train/")})
        out[interval] = records
    return out


def test_throughput_counts_the_tokens_of_the_steps_it_timed_on_every_rank(tmp_path):
    """The job goes at the slowest rank's pace (20 ms per step on its fake clock); its rate
    counts the tokens of the steps the clock timed, on both ranks."""
    results = run_ranks(_token_accounting, 2, str(tmp_path))
    first = results[0][5][0]
    assert first["train/step_time_ms"] == pytest.approx(max(STEP_MS))
    # steps 2..5 were timed: 2 ranks × 4 steps × 10 tokens in 4 × 20 ms
    assert first["train/tokens_per_sec"] == pytest.approx(2 * 4 * 10 / (4 * max(STEP_MS) / 1000))
    assert first["train/consumed_tokens"] == 1000 + 2000 + 2 * 4 * 10
    per_step = results[0][1]
    assert "train/step_time_ms" not in per_step[0] and "train/tokens_per_sec" not in per_step[0]
    assert per_step[0]["train/consumed_tokens"] == 3000
    assert per_step[1]["train/step_time_ms"] == pytest.approx(max(STEP_MS))
    assert per_step[1]["train/tokens_per_sec"] == pytest.approx(2 * 10 / (max(STEP_MS) / 1000))
    assert results[1][5] == results[0][5]


def test_the_last_step_logged_reads_back_a_bounded_number_of_records_past_the_last_train_record(tmp_path, monkeypatch):
    """A last job of one train record was read back whole to find the one before (a long job
    that logged once, say): past its last train record at most _READ_PAST_LAST_TRAIN records."""
    import json

    from distmetrics import runlog

    lines = [{"kind": "run", "step": 0}] + [{"kind": "eval", "step": s, "eval/loss": 1.0} for s in range(1, 31)]
    lines.append({"kind": "train", "step": 40, "train/loss": 1.0})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    decoded, decode = [], runlog.decode_line
    monkeypatch.setattr(runlog, "decode_line", lambda line: decoded.append(line) or decode(line) if line else None)
    monkeypatch.setattr(runlog, "_READ_PAST_LAST_TRAIN", 10)
    assert runlog.last_logged_step(path) == 40
    assert len(decoded) == 11  # the train record and 10 before it, not all 32


EVAL_CASES = {"negative": (-5.0, 10.0), "cancel": (-10.0, 10.0), "nan": (math.nan, 10.0), "good": (10.0, 10.0)}


def _bad_eval_tokens(rank: int, world: int, root: str) -> dict:
    import torch

    import distmetrics as dm

    out = {}
    cfg = dm.MetricsConfig(output_dir=root, console=False, tensorboard=False, log_memory=False)
    with dm.Monitor(cfg) as monitor:
        for step, (case, tokens) in enumerate(EVAL_CASES.items(), start=1):
            try:
                monitor.log_eval(step, loss=torch.tensor(1.0 + rank), tokens=torch.tensor(tokens[rank]), time_ms=100.0)
                out[case] = "ok"
            except ValueError as err:
                out[case] = str(err)
        try:
            monitor.log_eval(9, loss=2.0, tokens=10, time_ms=torch.tensor(math.nan if rank else 50.0))
        except ValueError as err:
            out["time_ms"] = str(err)
    return out


def test_bad_eval_tokens_in_a_tensor_are_refused_after_the_record_on_every_rank(tmp_path):
    """log_eval checked tokens given as tensors nowhere: -5 on one rank gave eval/loss 1.33 for
    1.5 and 500 tokens/s; -10 and 10 dropped eval/loss without a word; NaN made everything NaN."""
    import distmetrics as dm

    results = run_ranks(_bad_eval_tokens, 2, str(tmp_path))
    assert results[0] == results[1]
    out = results[0]
    assert out["good"] == "ok"
    for case, shown in (("negative", "summed over ranks 5.0, the least a rank gave -5.0"),
                        ("cancel", "summed over ranks 0.0, the least a rank gave -10.0"), ("nan", "nan")):
        assert out[case].startswith(f"monitor.log_eval(step={list(EVAL_CASES).index(case) + 1}): tokens: "), out[case]
        assert shown in out[case] and "held NaN, inf or a negative value on some rank" in out[case]
        assert out[case].endswith("written without what they weigh or divide (eval/loss, eval/ppl, eval/gap, "
                                  "eval/tokens_per_sec)"), out[case]
    assert out["time_ms"].startswith("monitor.log_eval(step=9): time_ms: the slowest rank's")
    # the record keeps its loss: the message named eval/loss, eval/ppl and eval/gap among what was left out
    assert out["time_ms"].endswith("what they weigh or divide (eval/time_ms, eval/tokens_per_sec)"), out["time_ms"]
    records = {r["step"]: r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "eval"}
    assert sorted(records) == [1, 2, 3, 4, 9]  # every record written
    assert records[4]["eval/loss"] == pytest.approx(1.5) and records[4]["eval/tokens_per_sec"] == pytest.approx(200.0)
    for step in (1, 2, 3):
        assert not any(k in records[step] for k in ("eval/loss", "eval/ppl", "eval/tokens_per_sec")), records[step]
    assert "eval/time_ms" not in records[9] and "eval/tokens_per_sec" not in records[9]
    assert records[9]["eval/loss"] == pytest.approx(2.0)


@pytest.mark.parametrize("bad", [math.nan, -1e6], ids=["nan", "negative"])
def test_bad_tokens_in_a_tensor_are_refused_at_the_log_step_and_the_checkpoint(tmp_path, bad):
    """A tensor count is not read at the call (that would wait for the device). One holding NaN
    (or a negative count) at step 3 made step 5's train/loss, tokens/s and consumed tokens NaN
    (or -2.5e6 tokens/s) without a word, and progress.txt's token count NaN for every later
    checkpoint, across restarts. The log step writes its record without them and raises; a
    checkpoint saved before any log step raises before writing its progress line."""
    import torch

    import distmetrics as dm

    def job(out, log_interval):
        cfg = dm.MetricsConfig(output_dir=str(out), log_interval=log_interval, console=False, tensorboard=False,
                               log_memory=False, flops_per_token=6.0)
        with FakeClock() as clock, dm.Monitor(cfg) as monitor:
            for step in range(1, 6):
                clock.advance(100)
                monitor.step(step, loss=2.0, tokens=torch.tensor(bad if step == 3 else 1000.0))
            monitor.checkpoint_saved(5)

    with pytest.raises(ValueError, match=r"monitor.step\(tokens=...\): the tokens of the steps up to step 5, summed "
                                         r"over ranks, are (nan|-99\d000.0): a tensor given as tokens held "
                                         r"(NaN|a negative count) on rank 0"):
        job(tmp_path / "log", 5)
    [record] = [r for r in dm.read_jsonl(tmp_path / "log" / "metrics.jsonl") if r["kind"] == "train"]
    assert record["step"] == 5
    assert not any(k.startswith(("train/loss", "train/tokens", "train/consumed")) for k in record), record
    with pytest.raises(ValueError, match=r"monitor.checkpoint_saved\(5\): this job's tokens summed over ranks are"):
        job(tmp_path / "checkpoint", 10)
    assert not (tmp_path / "checkpoint" / "progress.txt").exists() or \
        "Saved checkpoint" not in (tmp_path / "checkpoint" / "progress.txt").read_text()
    # a job that goes on after the refusal: its token count leaves the refused interval out (it
    # held the bad count for the rest of the job, so every later checkpoint raised)
    cfg = dm.MetricsConfig(output_dir=str(tmp_path / "on"), log_interval=5, console=False, tensorboard=False,
                           log_memory=False)
    with dm.Monitor(cfg) as monitor:
        for step in range(1, 11):
            try:
                monitor.step(step, loss=2.0, tokens=torch.tensor(bad if step == 3 else 1000.0))
            except ValueError:
                assert step == 5
        monitor.checkpoint_saved(10)
    [saved] = [r for r in dm.read_jsonl(tmp_path / "on" / "metrics.jsonl") if r["kind"] == "progress"]
    assert saved["checkpoint/tokens"] == 5000.0


def _outweighed_negative_counts(rank: int, world: int) -> dict:
    """Rank 1 gives a tensor count of -5 at one step, rank 0 and the other steps 1000: first as tokens
    (log step 3), then as loss_tokens (log step 6), then as tokens after log step 6, saved at 7."""
    import torch

    import distmetrics as dm
    from tests.dist_utils import quiet_config

    def count(step, bad_step):
        return torch.tensor(-5.0 if rank == 1 and step == bad_step else 1000.0)

    out: dict = {}
    monitor = dm.Monitor(quiet_config(log_interval=3, log_throughput=True))
    for step in range(1, 8):
        try:
            monitor.step(step, loss=2.0, tokens=count(step, 2), loss_tokens=count(step, 5))
        except ValueError as err:
            out[step] = (str(err), sorted(monitor.last_metrics))
    monitor.step(8, loss=2.0, tokens=count(8, 8))
    for name, call in (("checkpoint", lambda: monitor.checkpoint_saved(8)), ("close", monitor.close)):
        try:
            call()
        except ValueError as err:
            out[name] = str(err)
    return out


def _nan_or_inf_tensor_count(rank: int, world: int) -> dict:
    """Rank 1 gives a tensor count of NaN, then inf, at step 1 of 2 (log_interval 2); every other count is 10."""
    import torch

    import distmetrics as dm
    from tests.dist_utils import quiet_config

    said: dict = {}
    for bad in (math.nan, math.inf):
        with dm.Monitor(quiet_config(log_interval=2)) as monitor:
            for step in (1, 2):
                try:
                    monitor.step(step, loss=1.0, tokens=torch.tensor(bad if rank == 1 and step == 1 else 10.0))
                except ValueError as err:
                    said.setdefault(repr(bad), []).append(str(err))
    return said


def test_a_nan_tensor_count_names_its_rank_and_an_inf_says_it_cannot():
    """A NaN count on one of 3 ranks was said as held "on some rank" though the least count's lane (NaN wins)
    carries its rank; an inf cannot be placed by that lane and is said so."""
    for said in run_ranks(_nan_or_inf_tensor_count, 3, timeout=120):
        assert sorted(said) == ["inf", "nan"], said
        for bad, where in (("nan", "NaN on rank 1"), ("inf", "inf on some rank")):
            assert len(said[bad]) == 1 and said[bad][0].startswith(
                f"monitor.step(tokens=...): the tokens of the steps up to step 2, summed over ranks, are {bad}: a "
                f"tensor given as tokens held {where}; accepted values"), said


def test_a_negative_tensor_count_that_the_others_outweigh_is_refused():
    """Tensor counts are not read at the call; only their sum over ranks was checked, so a rank's
    -5 tokens among counts of 1000 passed unseen and the throughput and train/loss were weighted by it.
    Each rank's least count now rides the log step's MAX pack: the record is written without what the
    count weighs, then every rank raises naming the rank; a checkpoint before the next log step raises."""
    for out in run_ranks(_outweighed_negative_counts, 2, timeout=120):
        assert sorted(out, key=str) == [3, 6, "checkpoint", "close"], out
        message, names = out[3]
        assert message.startswith("monitor.step(tokens=...): a tensor given as tokens on rank 1 in the steps up "
                                  "to step 3 held a negative count, -5.0, which the other counts outweigh"), message
        assert "train/loss" not in names and "train/tokens_per_sec" not in names, names
        message, names = out[6]
        assert message.startswith("monitor.step(loss_tokens=...): a tensor given as loss_tokens on rank 1 in the "
                                  "steps up to step 6 held a negative count, -5.0"), message
        assert "train/loss" not in names and "train/tokens_per_sec" in names, names
        assert out["checkpoint"].startswith("monitor.checkpoint_saved(8): this job's tokens summed over ranks are "
                                            "8995.0: a tensor given as monitor.step(tokens=...) since the last log "
                                            "step held a negative count on 1 rank(s)"), out["checkpoint"]  # 1-3 out
        assert out["close"].startswith("monitor.step(tokens=...): a tensor given as tokens on rank 1 in the steps "
                                       "up to step 8 held a negative count"), out["close"]


@pytest.mark.parametrize("tail", ["gap", "end", "gap alone", "evaluation alone"])
def test_steps_metrics_jsonl_lost_count_as_logged_for_a_restart(tmp_path, tail):
    """metrics.jsonl on a disk that filled at step 17, TensorBoard on another that logged to 30: the job ended
    with a gap record (steps 18-30) and an end record at 30. The last step logged was read as 17, so a restart
    from checkpoint 20 dropped nothing, and TensorBoard showed two jobs' values at steps 21-30. A job whose
    train records were all lost (a gap alone) trained too; one that only evaluated (its end record: it made no
    monitor.step) did not."""
    import json

    from distmetrics.runlog import last_logged_step

    lines = [{"kind": "run", "step": 0}, {"kind": "train", "step": 10, "train/loss": 1.0}]
    if tail == "evaluation alone":  # a job that only evaluated, its eval record lost: no restart of training
        lines += [{"kind": "run", "step": 0}, {"kind": "gap", "step": 0, "first_step": 5, "last_step": 5,
                                               "lost_records": 1, "error": "ENOSPC"},
                  {"kind": "end", "step": 0, "how": "closed its Monitor", "stepped": False}]
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        assert last_logged_step(tmp_path / "metrics.jsonl") == 10
        return
    if tail != "gap alone":
        lines += [{"kind": "run", "step": 0}, {"kind": "train", "step": 17, "train/loss": 1.0}]
    else:
        lines += [{"kind": "run", "step": 0}]
    if tail in ("gap", "gap alone"):
        lines.append({"kind": "gap", "step": 30, "first_step": 18, "last_step": 30 if tail == "gap" else 25,
                      "lost_records": 13, "error": "[Errno 28] No space left on device (ENOSPC)"})
    lines.append({"kind": "end", "step": 30 if tail != "gap alone" else 25, "how": "close()"})
    if tail == "gap":
        lines.pop()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert last_logged_step(tmp_path / "metrics.jsonl") == (25 if tail == "gap alone" else 30)


def test_a_job_that_wrote_tensor_statistics_and_crashed_before_its_first_log_step_counts_as_trained(tmp_path):
    """Job 2 resumed at 11, wrote tensor statistics at step 15 and crashed before its first log
    step: taken for a job that did not train, job 3 (from checkpoint 14) was no restart, and
    TensorBoard showed step 15's statistics twice."""
    import json

    import distmetrics as dm
    from distmetrics.runlog import last_logged_step

    lines = [{"kind": "run", "step": 0}, {"kind": "train", "step": 10, "train/loss": 1.0},
             {"kind": "run", "step": 0}, {"kind": "tensor_stats", "step": 15, "tensor_stats/fc1/activation/max": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert last_logged_step(tmp_path / "metrics.jsonl") == 15
    with dm.Monitor(_config(tmp_path, log_interval=5)) as monitor:
        for step in range(15, 21):
            monitor.step(step, loss=2.0, tokens=100)
    resume = [(r["from_step"], r["last_logged_step"]) for r in dm.read_jsonl(tmp_path / "metrics.jsonl")
              if r["kind"] == "resume"]
    assert resume == [(15, 15)]


def test_a_job_that_ended_with_steps_unwritten_is_not_said_to_have_logged_them(tmp_path, caplog):
    """Job A logs steps 10..40 and leaves its Monitor on an error at step 46 (its end record: step 46,
    6 steps unwritten). Job B resuming from checkpoint 40 was said to resume at or before step 46
    'the last step an earlier job logged here' (a resume record, a warning, summary's 'resumed'): no
    sink had 41-46. Resuming from 30 it does, at 40."""
    import distmetrics as dm

    for out, first in ((tmp_path / "after", 41), (tmp_path / "before", 31)):
        with pytest.raises(KeyError), dm.Monitor(_config(out, log_interval=10)) as monitor:
            for step in range(1, 47):
                monitor.step(step, loss=1.0, tokens=100)
            raise KeyError("the data loader died")
        [end] = [r for r in dm.read_jsonl(out / "metrics.jsonl") if r["kind"] == "end"]
        assert (end["step"], end["unwritten_steps"]) == (46, 6)
        caplog.clear()
        _job(out, range(first, 61), loss=2.0)
        resume = [(r["from_step"], r["last_logged_step"]) for r in dm.read_jsonl(out / "metrics.jsonl")
                  if r["kind"] == "resume"]
        assert resume == ([] if first == 41 else [(31, 40)]), (first, resume)
        assert ("at or before step" in caplog.text) == (first == 31), caplog.text
