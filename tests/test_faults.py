"""Faults injected for real: ranks out of step on real gloo ranks (a rank that makes another call,
skips one, or is SIGKILLed), bad arguments, an unwritable or shared output folder, a Monitor made
before the process group. Every fault raises a clear error within a bound — never a hang, a
SIGABRT or a silently wrong record."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.dist_utils import quiet_config, run_ranks

TIMEOUT_S = 2.0


def _outcome(fn) -> tuple:
    start = time.monotonic()
    try:
        fn()
        return "ok", "", time.monotonic() - start
    except Exception as err:  # noqa: BLE001 - the test reads the type and message
        return type(err).__name__, str(err), time.monotonic() - start


def _out_of_step(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import distmetrics as dm

    out = {}
    cfg = quiet_config(log_interval=2, hang_timeout_s=TIMEOUT_S)
    # 1. log_eval on rank 0 while rank 1 makes a log step
    monitor = dm.Monitor(cfg)
    monitor.step(1)
    out["eval_vs_step"] = _outcome(lambda: monitor.log_eval(2, loss=1.0) if rank == 0 else monitor.step(2))
    dist.barrier()
    # 2. only rank 0 keeps calling monitor.step; rank 1 stops after start-up
    monitor = dm.Monitor(cfg)
    out["only_rank0"] = _outcome(lambda: [monitor.step(s) for s in (1, 2)]) if rank == 0 else ("ok", "", 0.0)
    dist.barrier()
    # 3. checkpoint_saved on rank 0 only (without the check: gloo aborts the process)
    monitor = dm.Monitor(cfg)
    monitor.step(1)
    out["checkpoint_one_rank"] = _outcome(lambda: monitor.checkpoint_saved(1) if rank == 0 else monitor.step(2))
    dist.barrier()
    # 4. a user's collector hands over None on rank 0 only
    monitor = dm.Monitor(cfg, collectors=[_Probe(rank)])
    monitor.step(1)
    out["bad_sample"] = _outcome(lambda: monitor.step(2))
    dist.barrier()
    # 5. Megatron's timer report with barrier=True on rank 0 while rank 1 makes a log step
    monitor = dm.Monitor(quiet_config(log_interval=1, hang_timeout_s=TIMEOUT_S, timing_log_level=2))
    monitor.step(1)
    monitor.timers("fwd", 1).start()
    report = lambda: monitor.timers.get_all_timers_string(["fwd"], barrier=True)  # noqa: E731
    out["report_vs_step"] = _outcome(report if rank == 0 else lambda: monitor.step(2))
    dist.barrier()
    # 6. a timer started with barrier=True on rank 1 only, right after its log step's publish (within
    # publish_every_s), while rank 0 makes a log step: rank 0 names it; rank 1 waits in the barrier,
    # met below by rank 0's
    monitor = dm.Monitor(quiet_config(log_interval=1, hang_timeout_s=TIMEOUT_S, timing_log_level=2))
    monitor.step(1)
    if rank == 0:
        out["timer_barrier_one_rank"] = _outcome(lambda: monitor.step(2))
        dist.barrier()
    else:
        out["timer_barrier_one_rank"] = _outcome(lambda: monitor.timers("fwd", 1).start(barrier=True))
    dist.barrier()
    # 7. the same timer barrier every step on every rank: what each rank publishes to the store
    out["barrier_every_step"] = _published_with_barriers(dm, ("fwd",))
    # 8. barriers of two timers in turn every step (Megatron's forward-backward and optimizer at level 1)
    out["two_barriers_every_step"] = _published_with_barriers(dm, ("forward-backward", "optimizer"))
    return out


def _published_with_barriers(dm, timers: tuple) -> tuple:
    """30 steps, each timing ``timers`` in turn with barrier=True: the calls this rank published to the
    store, the seconds it took, and the guard's publish_every_s."""
    monitor = dm.Monitor(quiet_config(log_interval=100, hang_timeout_s=TIMEOUT_S, timing_log_level=2))
    guard, published = monitor._guard, []
    publish = guard._publish
    guard._publish = lambda: (published.append(guard._last), publish())
    start = time.monotonic()
    for step in range(1, 31):
        for name in timers:
            monitor.timers(name, 1).start(barrier=True)
            monitor.timers(name, 1).stop()
        monitor.step(step)
    took, calls = time.monotonic() - start, list(published)  # close()'s own publishes left out
    monitor.close()
    return calls, took, guard.publish_every_s


class _Probe:
    """A user's collector whose reading failed on rank 0 (None) and worked on the others."""

    name, after = "probe", ()

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def take_samples(self, ctx):
        from distmetrics.reduce import Sample

        return [Sample("probe", None if self.rank == 0 else 1.0, "mean")]

    def finalize(self, metrics, ctx):
        return []

    def close(self):
        pass


@pytest.fixture(scope="module")
def out_of_step():
    return run_ranks(_out_of_step, 2, timeout=120)


@pytest.mark.parametrize("case,calls", [
    ("eval_vs_step", {0: "monitor.log_eval(step=2)", 1: "monitor.step(step=2)"}),
    ("checkpoint_one_rank", {0: "monitor.checkpoint_saved(step=1)", 1: "monitor.step(step=2)"}),
    # the report's barrier came before its arrival check: rank 0 waited there unnamed, without a bound
    ("report_vs_step", {0: "timers report (log, write or get_all_timers_string)", 1: "monitor.step(step=2)"})])
def test_different_calls_on_different_ranks_raise_on_both_naming_the_other(out_of_step, case, calls):
    """The last rank to arrive sees that the calls differ and marks the guarded call so: both raise
    then, naming every rank's call (not "did not arrive" after hang_timeout_s)."""
    for rank in (0, 1):
        kind, message, _ = out_of_step[rank][case]
        assert kind == "HangError", message
        assert f"rank {rank} is at {calls[rank]}, guarded call #" in message, message
        assert f"where the ranks made different calls: {calls[0]} on rank 0; {calls[1]} on rank 1" in message, message


def _at_different_calls(rank: int, world: int) -> dict:
    """hang_timeout_s 60: log_eval on rank 0 where rank 1 makes a log step; then, log_interval 1,
    step(3) on rank 0 where rank 1 (its loop skipped step 3) makes step(4)."""
    import torch.distributed as dist

    import distmetrics as dm

    out = {}
    monitor = dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=60))
    monitor.step(1)
    out["eval_vs_step"] = _outcome(lambda: monitor.log_eval(2, loss=1.0) if rank == 0 else monitor.step(2))
    dist.barrier()
    monitor = dm.Monitor(quiet_config(log_interval=1, hang_timeout_s=60))
    for step in (1, 2):
        monitor.step(step, loss=1.0)
    out["step_vs_step"] = _outcome(lambda: monitor.step(3 + rank, loss=1.0))
    return out


@pytest.fixture(scope="module")
def at_different_calls():
    return run_ranks(_at_different_calls, 2, timeout=150)


@pytest.mark.parametrize("case,calls", [
    ("eval_vs_step", {0: "monitor.log_eval(step=2)", 1: "monitor.step(step=2)"}),
    ("step_vs_step", {0: "monitor.step(step=3)", 1: "monitor.step(step=4)"})])
def test_ranks_at_different_calls_or_steps_raise_at_once_naming_each_ranks_call(at_different_calls, case, calls):
    """Each rank waited at a counter of its own call and step, so none completed and every rank
    waited all of hang_timeout_s (300 s by default) for a HangError, although every rank had
    arrived at that guarded call and the mismatch was known. The last to arrive now says so."""
    for rank in (0, 1):
        kind, message, seconds = at_different_calls[rank][case]
        assert kind == "HangError", (rank, kind, message)
        assert f"rank {rank} is at {calls[rank]}, guarded call #" in message, message
        assert f"where the ranks made different calls: {calls[0]} on rank 0; {calls[1]} on rank 1" in message, message
        assert seconds < 30, (seconds, message)  # at once, not at hang_timeout_s (60 s)


def test_a_bad_value_on_one_rank_is_left_out_there_and_raised_on_every_rank(out_of_step):
    """Without the check the value fails inside the SUM pack, after the MAX all-reduce: rank 1
    then waits in the SUM all-reduce for a rank that will never come. The Sample made in take_samples
    refuses it: that collector hands over nothing on rank 0, the record is written without it, and
    both ranks raise at once (rank 1 waited hang_timeout_s for rank 0, which had left)."""
    kind, message, _ = out_of_step[0]["bad_sample"]
    assert kind == "CollectorFailed" and message.startswith(
        "the 'probe' collector's take_samples raised TypeError: Sample 'probe': expected a number or a 1-element "
        "tensor, got NoneType"), message
    kind, message, seconds = out_of_step[1]["bad_sample"]
    assert kind == "CollectorFailed", message
    assert message.startswith("rank 0's collector 'probe' raised in take_samples"), message
    assert seconds < TIMEOUT_S


def test_a_timer_barrier_on_one_rank_is_named_by_the_rank_that_went_on(out_of_step):
    """A timer's barrier is not an arrival check (it can come every step); it is published as
    the rank's last call, so the rank that went on names it rather than the step before."""
    kind, message, _ = out_of_step[0]["timer_barrier_one_rank"]
    assert kind == "HangError" and "rank 1: last call timers('fwd').start(barrier=True)" in message, message
    assert out_of_step[1]["timer_barrier_one_rank"][0] == "ok"  # met by rank 0's own barrier after its error


def test_a_timer_barrier_every_step_is_published_once_per_publish_of_another_call(out_of_step):
    """The barrier is published at once only where the store holds another call for the rank: the
    same barrier at the next steps is not, so the store takes at most one more write per publish of
    a step (throttled to one per publish_every_s), not one per step."""
    barrier = "timers('fwd').start(barrier=True)"
    for rank in (0, 1):
        published, seconds, every_s = out_of_step[rank]["barrier_every_step"]
        assert published[0] == barrier, published  # the first, right after Monitor()'s publish
        assert all(not (a == b == barrier) for a, b in zip(published, published[1:])), published
        others = [call for call in published if call != barrier]
        assert published.count(barrier) <= 1 + len(others) <= 2 + int(seconds / every_s), (published, seconds)


def test_barriers_of_two_timers_in_turn_are_published_at_most_ten_times_a_second(out_of_step):
    """Each of two barriers in turn is not the call the store holds: both were written at every step (60
    writes in 30 steps of milliseconds). An urgent write now waits a tenth of publish_every_s after the
    last one."""
    from distmetrics.guard import URGENT_SHARE

    for rank in (0, 1):
        published, seconds, every_s = out_of_step[rank]["two_barriers_every_step"]
        barriers = [call for call in published if "barrier=True" in call]
        assert barriers[0] == "timers('forward-backward').start(barrier=True)", published
        assert len(barriers) <= 1 + int(seconds / (every_s / URGENT_SHARE)), (published, seconds)


def test_a_rank_that_stops_calling_is_named_with_its_last_call(out_of_step):
    kind, message, _ = out_of_step[0]["only_rank0"]
    assert kind == "HangError" and "rank 1: last call Monitor()" in message


def _eval_vs_step_unguarded(rank: int, world: int) -> tuple:
    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=0))  # no arrival check
    monitor.step(1, loss=5.0)
    return _outcome(lambda: monitor.log_eval(2, loss=1.0) if rank == 1 else monitor.step(2, loss=5.0))


def test_a_log_eval_met_by_a_log_step_of_the_same_number_raises_without_the_arrival_check():
    """With hang_timeout_s 0 (or a sub-group, which is not guarded) the two reductions met in the
    same collectives and were merged: rank 0's train record held rank 1's eval/loss, and the
    evaluation was never written. The MAX pack's digest lanes carry the call: both ranks raise."""
    for rank, (kind, message, _) in enumerate(run_ranks(_eval_vs_step_unguarded, 2, timeout=60)):
        assert kind == "RuntimeError", message
        call = "monitor.log_eval" if rank == 1 else "monitor.step"
        assert f"ranks made different monitor calls at step 2: this rank is in {call} " in message, message


def _colliding_names(rank: int, world: int, root: str) -> dict:
    import distmetrics as dm

    out = {}
    for case, (mine, theirs) in {"minmax": (("x", "minmax"), ("x/max", "mean")),
                                 "all": (("x", "all"), ("x/rank0", "mean"))}.items():
        monitor = dm.Monitor(quiet_config(log_interval=1, hang_timeout_s=TIMEOUT_S, json_log=True,
                                          output_dir=f"{root}/{case}"))
        name, reduce = mine if rank == 0 else theirs  # each rank's own check passes
        for step in (1, 2):
            monitor.record(name, 5.0, reduce=reduce)
            monitor.record("ok", 1.0 + rank)
            out[case, step] = _outcome(lambda: monitor.step(step, loss=2.0 + rank))
        monitor.close()
    return out


def test_names_that_collide_only_across_ranks_raise_on_every_rank(tmp_path):
    """One rank's minmax x writes x/max, another rank sends x/max (or x/rank0 beside an 'all' x,
    which JSONL writes per rank): the record held one of the two values and the other vanished.
    The agreed names go through the rules each rank applies to its own: both ranks raise, at every
    log step, once the record is written without either name (before, no record was written)."""
    import distmetrics as dm

    results = run_ranks(_colliding_names, 2, str(tmp_path), timeout=60)
    for case in ("minmax", "all"):
        records = [r for r in dm.read_jsonl(tmp_path / case / "metrics.jsonl") if r["kind"] == "train"]
        assert [r["step"] for r in records] == [1, 2]
        for record in records:  # the means of 2 and 3, and of 1 and 2
            assert record["train/loss"] == 2.5 and record["ok"] == 1.5, record
            assert not [key for key in record if key == "x" or key.startswith("x/")], record
    for result in results:
        for step in (1, 2):
            kind, message, _ = result["minmax", step]
            assert kind == "ValueError" and ("metric 'x/max' from rank 1 (mean) would write 'x/max', which metric 'x' "
                                             "from rank 0 (minmax) writes already") in message, message
            kind, message, _ = result["all", step]
            assert kind == "ValueError" and ("metric 'x/rank0' from rank 1 (mean) would write 'x/rank0', which JSONL "
                                             "uses for a rank of the 'all' metric 'x'") in message, message
            assert message.endswith("(left out of this record)"), message


class _Sends:
    """A collector of the user's that hands over one sum on its rank only."""

    after, writes = (), ()

    def __init__(self, name: str, metric: str, value: float, rank: int, on: int) -> None:
        self.name, self.metric, self.value, self.rank, self.on = name, metric, value, rank, on

    def take_samples(self, ctx):
        import distmetrics as dm

        return [dm.Sample(self.metric, self.value, "sum")] if self.on in (self.rank, "all") else []

    def finalize(self, metrics, ctx):
        return []

    def close(self):
        pass


def _one_name_two_writers(rank: int, world: int, root: str) -> dict:
    import distmetrics as dm

    collectors = [_Sends("mine", "foo", 5.0, rank, 0), _Sends("a", "bar", 2.0, rank, 0),
                  _Sends("b", "bar", 3.0, rank, 1)]
    monitor = dm.Monitor(quiet_config(log_interval=1, hang_timeout_s=TIMEOUT_S, json_log=True, output_dir=root),
                         collectors=collectors)
    out = {}
    for step in (1, 2, 3):
        if rank == 1:
            monitor.record("foo", 7.0, reduce="sum")
        if step == 3:  # 'b' sends nothing more; 'a' sends bar on every rank: one writer
            collectors[1].on, collectors[2].on = "all", -1
        monitor.record("ok", 1.0, reduce="sum")
        out[str(step)] = _outcome(lambda: monitor.step(step))
    monitor.close()
    return out


def test_one_name_from_two_writers_on_different_ranks_is_refused_on_every_rank(tmp_path):
    """A collector's ``foo`` on rank 0 and ``monitor.record("foo")`` on rank 1 (or two collectors' ``bar``)
    were summed into one value, 12.0, without a word; on one rank the same is refused. The ranks agree each
    name with its writer: both names are left out and raised on every rank while both writers send them,
    and a name is written again once one writer sends it (the writer is part of the refused names a rank
    sends: its change alone ends the refusal, as a kind's does)."""
    import distmetrics as dm

    results = run_ranks(_one_name_two_writers, 2, str(tmp_path), timeout=120)
    for result in results:
        for step in "12":
            kind, message, _ = result[step]
            assert kind == "ValueError", (step, result[step])
            assert ("metric 'foo' is sent by the 'mine' collector on rank 0 and by the Monitor (monitor.record, "
                    "monitor.step or its own collectors) on rank 1: a name is one writer's") in message, message
            assert "metric 'bar' is sent by the 'a' collector on rank 0 and by the 'b' collector on rank 1" in message
        kind, message, _ = result["3"]  # foo's clash lasts (left out again, no negotiation); bar's is over
        assert kind == "ValueError" and "metric 'foo' is sent by" in message and "'bar'" not in message, message
    records = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records[:2]:
        assert record["ok"] == 2.0 and "foo" not in record and "bar" not in record, record
    assert records[2]["ok"] == 2.0 and records[2]["bar"] == 4.0 and "foo" not in records[2], records[2]  # 'a' on both


def test_names_that_collide_in_a_single_process_are_refused_as_across_ranks(tmp_path):
    """A single process (no process group) settles its names as a negotiation does: a collector's ``y``
    as ``minmax`` beside its ``y/max`` (and ``w`` as ``all`` beside ``w/rank0``) wrote the second value
    over the first without a word. Both are left out and raised at each log step the collector sends
    both (a new name beside them included); once it sends ``y`` and ``w`` alone, they are written."""
    import distmetrics as dm

    class Both:
        name, after, writes = "both", (), ("y", "w")

        def __init__(self) -> None:
            self.clash = True

        def take_samples(self, ctx):
            samples = [dm.Sample("y", 1.0, "minmax"), dm.Sample("w", 3.0, "all"), dm.Sample("ok", 2.0, "sum")]
            if ctx.step == 2:  # a new name while the clash lasts: said all the same
                samples.append(dm.Sample("z", 1.0, "sum"))
            clashing = [dm.Sample("y/max", 99.0, "max"), dm.Sample("w/rank0", 98.0, "sum")]
            return samples + (clashing if self.clash else [])

        def finalize(self, metrics, ctx):
            return []

        def close(self):
            pass

    both = Both()
    monitor = dm.Monitor(quiet_config(log_interval=1, json_log=True, output_dir=str(tmp_path)), collectors=[both])
    for step in (1, 2):
        with pytest.raises(ValueError) as raised:
            monitor.step(step)
        assert "metric 'y/max' from rank 0 (max) would write 'y/max', which metric 'y' from rank 0 (minmax) writes " \
            "already" in str(raised.value) and "'w/rank0'" in str(raised.value), raised.value
    both.clash = False
    monitor.step(3)
    monitor.close()
    records = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    for record in records[:2]:
        assert record["ok"] == 2.0 and not [key for key in record if key[:2] in ("y", "y/", "w", "w/")], record
    assert records[2]["y/max"] == records[2]["y/min"] == 1.0 and records[2]["w/rank0"] == 3.0, records[2]


def _kind_flip(rank: int, world: int) -> tuple:
    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=TIMEOUT_S))
    for step in (1, 2):
        if rank == 0:
            monitor.record("x", 1.0, reduce="sum")
        monitor.step(step)
    for step in (3, 4):
        if rank == 1:
            monitor.record("x", 1.0, reduce="mean")  # rank 1's own first use of x
    return _outcome(lambda: [monitor.step(step) for step in (3, 4)])


def test_a_name_reduced_one_way_on_one_rank_and_another_way_later_on_another_raises():
    """Each rank checks its own calls; x was a sum on rank 0 for one interval and a mean on rank 1
    in the next, and the record read 2, then 1, without a word. The agreed kinds are remembered."""
    for kind, message, _ in run_ranks(_kind_flip, 2, timeout=60):
        assert kind == "ValueError", message
        assert "metric 'x' was reduced as 'sum' at an earlier log step and now as 'mean' on rank 1;" in message


def _sub_group(rank: int, world: int) -> list:
    import logging

    import torch.distributed as dist

    import distmetrics as dm

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    monitor = dm.Monitor(quiet_config(hang_timeout_s=TIMEOUT_S), group=dist.new_group(list(range(world))))
    monitor.close()
    return seen


def test_a_monitor_on_a_sub_group_says_the_arrival_check_is_off():
    """The arrival check needs every rank of the world; on another group it was off without a word.
    The group's first rank says it, once for the job (every rank of it said it)."""
    for rank, seen in enumerate(run_ranks(_sub_group, 2, timeout=60)):
        said = [m for m in seen if "arrival check (hang_timeout_s=2) cannot run" in m]
        assert len(said) == (1 if rank == 0 else 0), seen


def _two_groups(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    import distmetrics as dm

    groups = [dist.new_group([0]), dist.new_group([1, 2])]
    mine = 0 if rank == 0 else 1
    for writer in ("first", "last"):
        cfg = quiet_config(output_dir=f"{root}/{writer}/g{mine}", json_log=True, writer_rank=writer, log_interval=2,
                           hang_timeout_s=0)
        with dm.Monitor(cfg, group=groups[mine]) as monitor:
            for step in (1, 2):
                monitor.step(step, loss=float(rank))


def test_a_monitor_on_a_group_without_global_rank_0_writes_from_the_groups_own_rank(tmp_path):
    """The writer was global rank 0 (or the world's last): a Monitor on ranks [1, 2] computed its
    records and wrote none, without a word."""
    import distmetrics as dm

    run_ranks(_two_groups, 3, str(tmp_path), timeout=120)
    for writer in ("first", "last"):
        for group, loss, ranks in ((0, 0.0, [0]), (1, 1.5, [1, 2])):
            records = list(dm.read_jsonl(tmp_path / writer / f"g{group}" / "metrics.jsonl"))
            assert [r["train/loss"] for r in records if r["kind"] == "train"] == [loss]
            [run] = [r for r in records if r["kind"] == "run"]
            assert run["writer_rank"] == (ranks[0] if writer == "first" else ranks[-1])


JOB_RANKS = ((0, 1), (2, 3))
"""Two independent jobs in one 4-rank world, each with its own ``Monitor(group=...)``."""
JOB_LOG_INTERVAL = (2, 4)
FWD_MS = {2: 10.0, 3: 30.0}
"""Job 1's timed ``fwd`` per step (on the fake clock), by rank."""


def _job_loss(rank: int, step: int) -> float:
    return float((rank + 1) * step)


def _job_tokens(rank: int) -> int:
    return 10 * (rank + 1)


def _two_jobs(rank: int, world: int, root: str) -> dict:
    """Job 0 (ranks 0, 1) logs every 2 steps; job 1 (ranks 2, 3) every 4, times ``fwd`` behind a
    barrier and prints Megatron's timer report at step 2. Each saves a checkpoint at step 4, 10 s
    (on a hand-moved wall clock) after its Monitor was made."""
    import logging
    import types

    import torch
    import torch.distributed as dist

    import distmetrics as dm
    import distmetrics.checkpoints as checkpoints
    from tests.dist_utils import FakeClock

    said, reports = [], []
    handler = logging.Handler()
    handler.emit = lambda record: (reports if record.name == "distmetrics.timers" else said).append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    logging.getLogger("distmetrics.timers").setLevel(logging.INFO)
    groups = [dist.new_group(list(ranks)) for ranks in JOB_RANKS]  # every rank makes every group
    job = rank // 2
    cfg = quiet_config(output_dir=f"{root}/job{job}", json_log=True, log_progress=True, log_throughput=True,
                       log_interval=JOB_LOG_INTERVAL[job], timing_log_level=1, timing_log_option="minmax",
                       flops_per_token=1e9, peak_tflops=0.1, hang_timeout_s=0)
    out: dict = {"refused": _outcome(lambda: dm.Monitor(cfg, group=groups[1 - job]))}  # the other job's group
    wall = [1_000_000.0]
    saved_time, checkpoints.time = checkpoints.time, types.SimpleNamespace(time=lambda: wall[0])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    records, norms = {}, []
    try:
        with FakeClock() as clock, dm.Monitor(cfg, model=model, group=groups[job]) as monitor:
            for step in (1, 2, 3, 4):
                if job == 1:
                    fwd = monitor.timers("fwd", log_level=1)
                    fwd.start(barrier=True)
                    clock.advance(FWD_MS[rank])
                    fwd.stop(barrier=True)
                    if step == 2:
                        monitor.timers.log(["fwd"])
                clock.advance(100.0)
                torch.manual_seed(100 * rank + step)
                model.zero_grad()
                model(torch.randn(5, 4)).pow(2).sum().backward()
                for p in model.parameters():  # data parallel within the job
                    dist.all_reduce(p.grad, group=groups[job])
                    p.grad /= len(JOB_RANKS[job])
                truth = sum(p.grad.double().pow(2).sum() for p in model.parameters()).sqrt().item()
                norms.append((float(monitor.clip_grad_norm_(1e9)), truth))
                monitor.record("rank_id", float(rank), reduce="all")
                metrics = monitor.step(step, loss=_job_loss(rank, step), tokens=_job_tokens(rank))
                if metrics is not None:
                    ids = metrics["rank_id"]
                    records[step] = {**{k: v for k, v in metrics.items() if k.startswith(("train/", "grad_norm",
                                                                                         "timers/fwd"))},
                                     "rank_id": (list(ids), list(ids.rank_ids()))}
            wall[0] += 10.0
            monitor.checkpoint_saved(4)
    finally:
        checkpoints.time = saved_time
    out.update(records=records, norms=norms, said=said, reports=reports)
    return out


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_jobs")
    return root, run_ranks(_two_jobs, 4, str(root), timeout=180)


def test_two_jobs_in_one_world_reduce_their_own_ranks_values_at_their_own_log_interval(two_jobs):
    """The start-up gather ran over the world: two jobs' Monitors waited for each other, and with
    different log_interval they were refused ("config key log_interval differs between ranks")."""
    _, results = two_jobs
    for job, ranks in enumerate(JOB_RANKS):
        every = JOB_LOG_INTERVAL[job]
        for rank in ranks:
            records = results[rank]["records"]
            assert sorted(records) == list(range(every, 5, every))
            for step, record in records.items():
                steps = range(step - every + 1, step + 1)
                weighted = sum(_job_loss(r, s) * _job_tokens(r) for r in ranks for s in steps)
                tokens = sum(_job_tokens(r) for r in ranks for _ in steps)
                assert record["train/loss"] == pytest.approx(weighted / tokens, rel=1e-12)
                assert record["train/consumed_tokens"] == step * sum(_job_tokens(r) for r in ranks)
                assert record["grad_norm"] == pytest.approx(results[rank]["norms"][step - 1][1], rel=1e-6)
            for measured, truth in results[rank]["norms"]:
                assert measured == pytest.approx(truth, rel=1e-6)


def test_a_barrier_timer_and_the_timer_report_of_one_job_wait_for_its_own_ranks_only(two_jobs):
    """Timers ignored the group: barrier=True waited for the world, and timers.log gathered from
    it, so job 1 hung there while job 0 trained on."""
    _, results = two_jobs
    for rank in JOB_RANKS[1]:
        record = results[rank]["records"][4]
        assert (record["timers/fwd"], record["timers/fwd/max_rank"]) == (pytest.approx(30.0), 3)
        assert (record["timers/fwd/min"], record["timers/fwd/min_rank"]) == (pytest.approx(10.0), 2)
    # Megatron's report on the job's last rank: two steps of each rank's fwd
    assert results[3]["reports"] == ["(min, max) time across ranks (ms):\n    fwd " + "." * 44 + ": (20.00, 60.00)"]
    assert results[2]["reports"] == [] and results[0]["reports"] == results[1]["reports"] == []


def test_every_rank_values_of_a_job_in_a_group_are_its_ranks_named_by_global_rank(two_jobs):
    """An ``all`` value was a list as long as the world, None for the other job's ranks."""
    import distmetrics as dm

    root, results = two_jobs
    for job, ranks in enumerate(JOB_RANKS):
        for rank in ranks:
            for record in results[rank]["records"].values():
                assert record["rank_id"] == ([float(r) for r in ranks], list(ranks))
        trains = [r for r in dm.read_jsonl(root / f"job{job}" / "metrics.jsonl") if r["kind"] == "train"]
        assert {k for r in trains for k in r if k.startswith("rank_id/rank")} == {f"rank_id/rank{r}" for r in ranks}


def test_the_run_record_progress_and_checkpoint_of_a_job_in_a_group_count_its_own_gpus(two_jobs):
    """The run record named the world's 4 ranks, progress.txt said "# GPUs: 4" and the checkpoint's
    TFLOP/s/GPU divided the job's FLOPs by the world's 4 GPUs (half the truth)."""
    import distmetrics as dm

    root, _ = two_jobs
    for job, ranks in enumerate(JOB_RANKS):
        records = list(dm.read_jsonl(root / f"job{job}" / "metrics.jsonl"))
        [run] = [r for r in records if r["kind"] == "run"]
        assert run["world_size"] == 2 and [r["rank"] for r in run["ranks"]] == list(ranks)
        assert run["writer_rank"] == ranks[0]
        [saved] = [r for r in records if r["kind"] == "progress"]
        tokens = 4 * sum(_job_tokens(r) for r in ranks)
        assert saved["checkpoint/tokens"] == tokens
        assert saved["checkpoint/job_tflops_per_gpu"] == pytest.approx(tokens * 1e9 / 10.0 / len(ranks) / 1e12)
        lines = (root / f"job{job}" / "progress.txt").read_text().splitlines()
        assert len(lines) == 2 and all("\t# GPUs: 2\t" in line for line in lines)


def test_a_warning_once_per_job_is_said_by_each_jobs_first_rank(two_jobs):
    """Once-per-job warnings were said by global rank 0 only: job 1 never heard its MFU was above 100%."""
    _, results = two_jobs
    for rank, out in enumerate(results):
        said = [m for m in out["said"] if "is above 100%" in m]
        assert len(said) == (1 if rank in (0, 2) else 0), out["said"]


def test_a_rank_outside_the_group_is_refused_before_any_collective(two_jobs):
    """get_world_size of the placeholder dist.new_group returns outside a group is -1: such a rank
    was told its Monitor was "made before init_process_group" (or "Group rank -2 is not part of
    group -100"), after the other ranks had gone into collectives."""
    _, results = two_jobs
    for rank, out in enumerate(results):
        kind, message, _ = out["refused"]
        assert kind == "ValueError" and f"rank {rank} is not one of the group's ranks" in message, message


def _clip_on_one_rank(rank: int, world: int) -> tuple:
    import torch

    import distmetrics as dm

    model = torch.nn.Linear(4, 4)
    monitor = dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=TIMEOUT_S), model=model)
    model(torch.ones(2, 4)).sum().backward()
    monitor.clip_grad_norm_(1.0)  # the first clip (every rank): the norm-type check, guarded; later ones are not
    monitor.step(1)
    if rank == 0:
        time.sleep(1.1)  # calls that are not collectives are published at most once a second
        return _outcome(lambda: monitor.clip_grad_norm_(1.0))  # rank 1 never clips
    return _outcome(lambda: monitor.step(2))


def test_a_clip_on_one_rank_is_named_as_the_call_it_hangs_in():
    """The clip's all-reduce is not guarded (it runs every step); the rank waiting at the log step
    named the clipping rank's call before it (monitor.step(step=1))."""
    kind, message, _ = run_ranks(_clip_on_one_rank, 2, may_die=(0,), timeout=60)[1]
    assert kind == "HangError" and "rank 0: last call monitor.clip_grad_norm_()" in message, message


def _clips_out_of_step(rank: int, world: int, p: float) -> tuple:
    """Rank 0 skips its clip at step 2, rank 2 at step 3: each clip's all-reduce after the first skip met
    other steps' (the gradients are the step's number, the same on every rank)."""
    import torch

    import distmetrics as dm

    model = torch.nn.Linear(4, 4)
    monitor = dm.Monitor(quiet_config(log_interval=5, hang_timeout_s=TIMEOUT_S), model=model)
    for step in range(1, 6):
        for param in model.parameters():
            param.grad = torch.full_like(param, float(step))
        if (rank, step) not in ((0, 2), (2, 3)):
            kind, message, _ = _outcome(lambda: monitor.clip_grad_norm_(1.0, p))
            if kind != "ok":
                scaled = [param.grad.unique().tolist() for param in model.parameters()]
                _outcome(monitor.close)  # the ranks' closes differ in step too: said on every rank
                return step, kind, message, scaled
        monitor.step(step)
    monitor.close()
    return None


@pytest.mark.parametrize("p", [2.0, math.inf, -math.inf, 0.0])
def test_clips_made_at_different_steps_raise_on_every_rank_naming_each_ranks_step(p):
    """The clip's all-reduce is not guarded; its lanes carry each rank's step (on the host: gloo), so the
    first all-reduce the ranks made at different steps raises on every rank, before any gradient is
    scaled, where its total mixed two steps' gradients (a sum, max or min of them, or a count)."""
    said = "(ranks 1, 2 after monitor.step(step=1); rank 0 after monitor.step(step=2))"
    for rank, result in enumerate(run_ranks(_clips_out_of_step, 3, p, timeout=120)):
        assert result is not None, f"rank {rank} clipped every step"
        step, kind, message, scaled = result
        assert (step, kind) == (3 if rank == 0 else 2, "HangError"), (rank, result)
        assert message.startswith("monitor.clip_grad_norm_: the ranks made this gradient norm's all-reduce at "
                                  f"different steps {said}"), message
        assert scaled == [[float(step)], [float(step)]], "a gradient was scaled"


def _clips_with_other_arguments(rank: int, world: int) -> list:
    """Both ranks clip with p = 1, then p = 2 (each agreed at its first call); then rank 1 passes p = 1 where
    rank 0 passes 2 (two sums of different powers, added), then max_norm 0.25 where rank 0 passes 0.5; then,
    with p = 0 and p = -1 agreed, p = 0 where rank 0 passes 2 and -1 where it passes 0 (their all-reduces
    held 3, 2 and 4 lanes: gloo ended both processes)."""
    import torch

    import distmetrics as dm

    model = torch.nn.Linear(4, 4)
    monitor = dm.Monitor(quiet_config(log_interval=5, hang_timeout_s=TIMEOUT_S), model=model)
    said = []
    for step, p, max_norm in ((1, 1.0, 0.5), (2, 2.0, 0.5), (3, 1.0 if rank else 2.0, 0.5),
                              (4, 2.0, 0.25 if rank else 0.5), (5, 0.0, 0.5), (6, -1.0, 0.5),
                              (7, 0.0 if rank else 2.0, 0.5), (8, -1.0 if rank else 0.0, 0.5)):
        for param in model.parameters():
            param.grad = torch.full_like(param, float(step))
        kind, message, _ = _outcome(lambda: monitor.clip_grad_norm_(max_norm, p))
        said.append((kind, message, [param.grad.unique().tolist() for param in model.parameters()]))
        monitor.step(step)
    _outcome(monitor.close)
    return said


def test_clips_with_other_arguments_on_one_rank_raise_on_every_rank_after_their_first_call():
    """The norm type and max_norm were agreed at each one's first call only: a rank that passed 1 where the
    others passed 2, both agreed before, added its sum of |g| to their sums of squares (FSDP2: a wrong
    grad_norm and every shard scaled by its own coefficient, unsaid), and a max_norm changed on one rank
    clipped to a norm no one asked for. The clip's lanes carry both at every call (gloo)."""
    for rank, said in enumerate(run_ranks(_clips_with_other_arguments, 2, timeout=120)):
        assert [kind for kind, _, _ in said] == ["ok", "ok", "HangError", "HangError", "ok", "ok", "HangError",
                                                 "HangError"], (rank, said)
        lead = "monitor.clip_grad_norm_: the ranks made this gradient norm's all-reduce with different arguments"
        assert said[2][1].startswith(f"{lead} (monitor.clip_grad_norm_(max_norm=0.5, norm_type=2) on rank 0; "
                                     "monitor.clip_grad_norm_(max_norm=0.5, norm_type=1) on rank 1)"), said[2][1]
        assert said[3][1].startswith(f"{lead} (monitor.clip_grad_norm_(max_norm=0.5, norm_type=2) on rank 0; "
                                     "monitor.clip_grad_norm_(max_norm=0.25, norm_type=2) on rank 1)"), said[3][1]
        for step, (given, other) in ((7, ("2", "0")), (8, ("0", "-1"))):
            assert said[step - 1][1].startswith(
                f"{lead} (monitor.clip_grad_norm_(max_norm=0.5, norm_type={given}) on rank 0; "
                f"monitor.clip_grad_norm_(max_norm=0.5, norm_type={other}) on rank 1)"), said[step - 1][1]
        assert [said[step - 1][2] for step in (3, 4, 7, 8)] == [[[float(step)]] * 2 for step in (3, 4, 7, 8)], \
            "a gradient was scaled"


def _bare_clips_with_other_arguments(rank: int, world: int) -> list:
    """dm.clip_grad_norm_ without a Monitor: p = 2, 0 and 1 agreed, then 0 on rank 1 where rank 0 passes 2 (rank 1
    read rank 0's sum of squares as its count), 1 where it passes 2, and another max_norm."""
    import torch

    import distmetrics as dm

    model = torch.nn.Linear(4, 4)
    said = []
    for step, p, max_norm in ((1, 2.0, 0.5), (2, 0.0, 0.5), (3, 1.0, 0.5), (4, 0.0 if rank else 2.0, 0.5),
                              (5, 1.0 if rank else 2.0, 0.5), (6, 2.0, 0.25 if rank else 0.5),
                              (7, 2.0, -0.0 if rank else 0.0)):  # one max_norm, two reprs
        for param in model.parameters():
            param.grad = torch.full_like(param, float(step))
        kind, message, _ = _outcome(lambda: dm.clip_grad_norm_(model.parameters(), max_norm, p))
        said.append((kind, message, [param.grad.unique().tolist() for param in model.parameters()]))
    return said


def test_clips_outside_a_monitor_with_other_arguments_on_one_rank_raise_on_every_rank():
    """Without a Monitor the argument lanes were not carried: ranks passing 2 and 0, or 2 and -1, each agreed
    before, returned totals of the other rank's powers (0.786 where torch gives 4.0) and clipped by their own
    coefficients, without a word (2 and 1 too). Under gloo they ride the all-reduce as a Monitor's do."""
    for rank, said in enumerate(run_ranks(_bare_clips_with_other_arguments, 2, timeout=120)):
        assert [kind for kind, _, _ in said] == ["ok"] * 3 + ["HangError"] * 3 + ["ok"], (rank, said)
        lead = "clip_grad_norm_: the ranks made this gradient norm's all-reduce with different arguments"
        for step, rank0, rank1 in ((4, "max_norm=0.5, norm_type=2", "max_norm=0.5, norm_type=0"),
                                   (5, "max_norm=0.5, norm_type=2", "max_norm=0.5, norm_type=1"),
                                   (6, "max_norm=0.5, norm_type=2", "max_norm=0.25, norm_type=2")):
            assert said[step - 1][1].startswith(f"{lead} (dm.clip_grad_norm_({rank0}) on rank 0; "
                                                f"dm.clip_grad_norm_({rank1}) on rank 1)"), said[step - 1][1]
            assert said[step - 1][2] == [[float(step)]] * 2, "a gradient was scaled"


def _killed(rank: int, world: int) -> tuple:
    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=TIMEOUT_S))
    if rank == 1:
        time.sleep(1.1)  # calls that are not collectives are published at most once a second
    monitor.step(1)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _outcome(lambda: monitor.step(2))


def test_a_killed_rank_is_named_by_the_rank_waiting_for_it():
    kind, message, _ = run_ranks(_killed, 2, may_die=(1,), timeout=60)[0]
    assert kind == "HangError" and "rank 1: last call monitor.step(step=1)" in message


def _differ_then_store_gone(rank: int, world: int, said: str) -> tuple:
    """log_eval(3) on rank 1, arriving last, where rank 0 makes its step-4 log step; rank 0, the store's host,
    ends at once after its HangError, while rank 1 is slower (by a second) to read the ranks' calls."""
    import distmetrics as dm
    from distmetrics.guard import CollectiveGuard

    if rank == 1:
        rows = CollectiveGuard._rows
        CollectiveGuard._rows = lambda self: (time.sleep(1.0), rows(self))[1]
    monitor = dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=TIMEOUT_S))
    for step in (1, 2, 3):
        monitor.step(step)
    if rank == 1:  # the last to arrive, so it finds the calls differ (arriving first, it may miss the mark
        time.sleep(0.5)  # between rank 0's writing it and its process ending, on a loaded machine)
    kind, message, _ = _outcome(lambda: monitor.log_eval(3, loss=1.0) if rank == 1 else monitor.step(4))
    if rank == 0:
        Path(said).write_text(message)
        os._exit(0)
    return kind, message


def test_a_rank_that_cannot_read_the_calls_still_says_they_differed(tmp_path):
    """Rank 1 read the mark that the ranks made different calls, then could not read which (the store
    gone with rank 0's process): it said only that the store became unreachable, with an internal
    exception's empty text (``_Differ: ``)."""
    said = tmp_path / "rank0.txt"
    kind, message = run_ranks(_differ_then_store_gone, 2, str(said), may_die=(0,), timeout=60)[1]
    assert "monitor.step(step=4) on rank 0; monitor.log_eval(step=3) on rank 1" in said.read_text()
    assert kind == "HangError" and "where the ranks made different calls (the last rank to arrive found it)" in \
        message and "_Differ" not in message, message
    assert message.startswith("distmetrics: rank 1 is at monitor.log_eval(step=3), guarded call #"), message


def _late(rank: int, world: int, late_s: list) -> tuple:
    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=TIMEOUT_S))
    monitor.step(1)
    time.sleep(late_s[rank])
    arrived = time.monotonic()
    kind, message, _ = _outcome(lambda: monitor.step(2))
    waited = time.monotonic() - arrived
    time.sleep(max(0.0, max(late_s) + 1.0 - late_s[rank] - waited))  # rank 0 (the store's host) goes on
    return kind, message, waited


@pytest.mark.parametrize("late_s", [[0.0, 1.75 * TIMEOUT_S], [0.0, 0.5 * TIMEOUT_S, 1.75 * TIMEOUT_S]],
                         ids=["2 ranks", "3 ranks"])
def test_a_rank_arriving_after_another_gave_up_raises_at_once(late_s):
    """Rank 0 raised its HangError after hang_timeout_s; a rank arriving later counted itself the
    last arrival, went into the log step's collective alone and waited there without a message
    (28 s, until rank 0's process ended; for ever where rank 0 catches its error and goes on, as here)."""
    results = run_ranks(_late, len(late_s), late_s, timeout=120)
    for rank, (kind, message, waited) in enumerate(results):
        assert kind == "HangError", (rank, kind, message)
        assert waited < TIMEOUT_S + 5, (rank, waited, message)
    # the late rank is told it was late, not that the others "may have died" (they had all arrived)
    late = results[-1][1]
    assert "but another rank had given up waiting there after hang_timeout_s" in late, late
    assert "this rank came late" in late and "may have died" not in late, late


def _store_host_killed(rank: int, world: int) -> tuple:
    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=TIMEOUT_S))
    monitor.step(1)
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    return _outcome(lambda: (monitor.step(2), monitor.close()))


def test_the_rank_hosting_the_store_killed_is_said_as_a_hang_not_a_bare_network_error():
    """Rank 0 hosts the c10d store: killed, the other rank's next guarded call raised a bare
    DistNetworkError ("Connection reset by peer") from the store, naming neither distmetrics
    nor the call."""
    kind, message, _ = run_ranks(_store_host_killed, 2, may_die=(0,), timeout=60)[1]
    assert kind == "HangError" and "the c10d store became unreachable" in message, (kind, message)
    assert "monitor.step(step=2)" in message, message


def _killed_inside_a_log_steps_collective(rank: int, world: int, out: str) -> tuple:
    """Rank 2 passes step 4's arrival check and its MAX all_reduce, then SIGKILLs itself as it enters the
    SUM all_reduce (the loss's mean, the recorded sum): the other ranks are in that collective without it."""
    import torch.distributed as dist

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=TIMEOUT_S, json_log=True, output_dir=out))
    at_step_4 = [False]
    if rank == 2:
        all_reduce = dist.all_reduce

        def dying(tensor, op=dist.ReduceOp.SUM, **kwargs):
            if at_step_4[0] and op == dist.ReduceOp.SUM:
                os.kill(os.getpid(), signal.SIGKILL)
            return all_reduce(tensor, op=op, **kwargs)

        dist.all_reduce = dying
    for step in (1, 2, 3):
        monitor.record("ranks", float(rank), reduce="sum")
        monitor.step(step, loss=float(rank + 1))
    at_step_4[0] = True
    start = time.monotonic()
    try:
        monitor.step(4, loss=float(rank + 1))
    except Exception as err:  # noqa: BLE001 - the test reads the type, message and cause
        cause = err.__cause__
        return (type(err).__name__, str(err), isinstance(err, dm.HangError), type(cause).__name__,
                isinstance(cause, RuntimeError) and str(cause).splitlines()[0] in str(err), time.monotonic() - start)
    return "ok", "", False, "", False, time.monotonic() - start


def test_a_rank_killed_inside_a_log_steps_collective_is_said_with_the_step_and_collective_not_a_bare_gloo_error(
        tmp_path):
    """The ranks left in the collective got gloo's own RuntimeError ("Connection closed by peer",
    "Connection reset by peer"), naming neither distmetrics, the step nor the collective: a dead peer
    read like a metrics bug. The records written before stay whole."""
    results = run_ranks(_killed_inside_a_log_steps_collective, 3, str(tmp_path), may_die=(2,), timeout=60)
    for rank in (0, 1):
        kind, message, is_hang_error, cause, cause_said, seconds = results[rank]
        assert kind == "PeerLostError" and is_hang_error, (rank, kind, message)
        assert f"failed on rank {rank} in monitor.step(step=4), in the SUM all_reduce" in message, message
        assert "a peer rank has probably gone (crashed, killed, out of memory)" in message, message
        assert cause in ("RuntimeError", "DistBackendError", "DistNetworkError") and cause_said, (cause, message)
        assert seconds < TIMEOUT_S, (rank, seconds)  # the collective's failure, not the arrival check's wait
    lines = (tmp_path / "metrics.jsonl").read_text().split("\n")
    assert lines[-1] == "", lines[-1]  # every line written is whole
    records = [json.loads(line) for line in lines[:-1]]
    assert [(r["kind"], r["step"]) for r in records] == [("run", 0), ("train", 2)]
    assert records[1]["train/loss"] == pytest.approx(sum(r + 1 for r in range(3)) / 3)
    assert records[1]["ranks"] == pytest.approx(2 * sum(range(3)))  # steps 1 and 2, every rank's


def _killed_inside_a_clips_all_reduce(rank: int, world: int) -> tuple:
    """Rank 1 SIGKILLs itself as it enters the second clip's all-reduce (the first clip's is the norm-type
    check's); rank 0 is in the all-reduce combining the ranks' gradient norms without it."""
    import torch
    import torch.distributed as dist

    import distmetrics as dm

    model = torch.nn.Linear(4, 4)
    monitor = dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=TIMEOUT_S), model=model)
    model(torch.ones(2, 4)).sum().backward()
    monitor.clip_grad_norm_(1.0)
    if rank == 1:
        dist.all_reduce = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    return _outcome(lambda: monitor.clip_grad_norm_(1.0))


def test_a_rank_killed_inside_a_clips_all_reduce_is_said_as_a_lost_peer():
    """The gradient norm's all-reduce runs at every step, outside any log step: a peer gone there gave
    the bare gloo error too."""
    kind, message, _ = run_ranks(_killed_inside_a_clips_all_reduce, 2, may_die=(1,), timeout=60)[0]
    assert kind == "PeerLostError", (kind, message)
    assert ("failed on rank 0 in the gradient norm (clip_grad_norm_ or measure_grad_norms), in the SUM all_reduce "
            "of the ranks' gradient norms: RuntimeError: ") in message, message


def test_only_the_backends_errors_in_a_collective_are_said_as_a_lost_peer():
    """A DistError, or the plain RuntimeError gloo raises, is said with the call, step and collective,
    and chained; any other RuntimeError (NotImplementedError, RecursionError) is raised as it is."""
    import torch.distributed as dist

    from distmetrics.peers import InCollective, PeerLostError

    for err in (NotImplementedError("no such op"), RecursionError("too deep"), ValueError("not a backend's")):
        with pytest.raises(type(err)) as caught, InCollective("the SUM all_reduce (sum and mean metrics)",
                                                               "monitor.step", 4):
            raise err
        assert caught.value is err and err.__cause__ is None
    # what the backend says decides the reading: a peer gone, one late (every rank may be alive), or the
    # backend's own cause (NCCL names it on a later line, kept)
    for err, reading in ((dist.DistNetworkError("Connection reset by peer"), "a peer rank has probably gone"),
                         (RuntimeError("Connection closed by peer\nmore"), "a peer rank has probably gone"),
                         (RuntimeError("[pair.cc:446] Timed out waiting 3000ms for recv"),
                          "a peer rank did not join this collective within the process group's timeout"),
                         (dist.DistBackendError("NCCL error: invalid usage\nLast error:\nDuplicate GPU detected"),
                          "the backend's message above names the cause")):
        with pytest.raises(PeerLostError) as caught, InCollective("the SUM all_reduce (sum and mean metrics)",
                                                                   "monitor.log_eval", 7):
            raise err
        said = f"in monitor.log_eval(step=7), in the SUM all_reduce (sum and mean metrics): {type(err).__name__}: "
        assert said + " ".join(str(err).split()) + " — " + reading in str(caught.value), str(caught.value)
        assert caught.value.__cause__ is err


def _dies_before_monitor(rank: int, world: int) -> tuple:
    import distmetrics as dm

    if rank == 1:  # killed while loading a checkpoint, say: it never makes a monitor call
        os.kill(os.getpid(), signal.SIGKILL)
    return _outcome(lambda: dm.Monitor(quiet_config(hang_timeout_s=TIMEOUT_S)))


def test_a_rank_that_dies_before_any_monitor_call_is_named_within_the_timeout():
    """The report read every rank's key from the store, and a rank that never made a guarded call
    has none: the read waited for it (the store's 30 min), so the hang report itself hung."""
    kind, message, seconds = run_ranks(_dies_before_monitor, 2, may_die=(1,), timeout=60)[0]
    assert kind == "HangError" and "rank 1: last call nothing published" in message, message
    assert "published 0.0 s ago" not in message and "s ago" not in message.split("rank 1:")[1], message  # no time
    assert seconds < TIMEOUT_S + 10


def _late_with_the_check_off(rank: int, world: int) -> tuple:
    """hang_timeout_s 0 on both ranks, the start-up bound lowered to 1 s; rank 1 comes 3 s late."""
    import time

    import distmetrics as dm
    from distmetrics import guard

    guard.START_WAIT_S = 1.0
    if rank == 1:
        time.sleep(3.0)
    return _outcome(lambda: dm.Monitor(quiet_config(hang_timeout_s=0)).close())


def test_with_the_check_off_the_start_up_check_waits_as_long_as_the_process_group_would():
    """The start-up check made with hang_timeout_s 0 gave up after its own bound (600 s) where the
    collective it stands before would have waited the process group's timeout (30 min here): a rank
    that came late then made every rank raise. It waits the longer of the two now."""
    for rank, (kind, message, _) in enumerate(run_ranks(_late_with_the_check_off, 2, timeout=60)):
        assert kind == "ok", (rank, kind, message)


def _check_on_one_rank_only(rank: int, world: int) -> dict:
    """hang_timeout_s 60 on rank 0 and 0 (the check off) on rank 1; then 0 on both, with a log step."""
    import distmetrics as dm

    out = {"mixed": _outcome(lambda: dm.Monitor(quiet_config(hang_timeout_s=60 if rank == 0 else 0)))}
    monitor = dm.Monitor(quiet_config(log_interval=1, hang_timeout_s=0))
    out["all off"] = monitor.step(1, loss=1.0 + rank)["train/loss"]
    monitor.close()
    return out


def test_a_rank_with_the_arrival_check_off_beside_ranks_with_it_on_is_named_at_once():
    """Rank 0 waited its whole hang_timeout_s at start-up (300 s by default) for rank 1, which
    skipped the check and waited in the start-up gather (then a bare gloo error there). The first
    call is checked with the check off too, as another call: both raise at once, naming both."""
    calls = {0: "Monitor()", 1: "Monitor() with hang_timeout_s 0 (the arrival check off)"}
    for rank, out in enumerate(run_ranks(_check_on_one_rank_only, 2, timeout=120)):
        kind, message, seconds = out["mixed"]
        assert kind == "HangError" and seconds < 30, (rank, kind, seconds, message)
        assert f"where the ranks made different calls: {calls[0]} on rank 0; {calls[1]} on rank 1" in message, message
        assert message.endswith("Give every rank the same hang_timeout_s."), message
        assert out["all off"] == 1.5


def _close_after_an_error(rank: int, world: int) -> tuple:
    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=4, hang_timeout_s=TIMEOUT_S))
    monitor.step(1)
    if rank == 1:
        return ("ok", "", 0.0)  # rank 1 goes on (and never closes)
    try:
        try:
            raise KeyError("the loader's own error")
        finally:
            monitor.close()  # the interval since the log step: a collective rank 1 does not join
    except Exception as err:  # noqa: BLE001 - the test reads the chain
        context = err.__context__
        return type(err).__name__, str(err), repr(context) if context is not None else None


def test_close_in_a_finally_keeps_the_callers_error_and_names_itself():
    """close() in a finally after the loop's own error: its HangError kept that error out of the
    traceback (raised "from None") and named the call monitor.step."""
    kind, message, context = run_ranks(_close_after_an_error, 2, timeout=60)[0]
    assert kind == "HangError" and "at monitor.close(step=1)" in message, message
    assert context == repr(KeyError("the loader's own error"))


def _unwritable(rank: int, world: int) -> tuple:
    import distmetrics as dm

    return _outcome(lambda: dm.Monitor(quiet_config(output_dir="/proc/x", json_log=True)))


def test_an_unwritable_output_dir_raises_on_every_rank_at_construction():
    for kind, message, _ in run_ranks(_unwritable, 2, timeout=60):
        assert kind == "ValueError"
        assert "rank 0: output_dir='/proc/x' cannot be written on the writer rank" in message and "Errno" in message


def _differing_settings(rank: int, world: int, root: str) -> tuple:
    import distmetrics as dm

    differing = dict(writer_rank="last", log_grad_norm_per_module=False, timing_log_level=2,
                     barrier_with_L1_time=False, spike_factor=2.0) if rank == 0 else {"spike_factor": 5}
    stats = ["max", "mean"] if rank == 0 else ["mean", "max"]  # the same statistics, listed in another order
    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc1"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": stats}}}}
    return _outcome(lambda: dm.Monitor(quiet_config(output_dir=root, json_log=True, **differing,
                                                    tensor_inspect={"enabled": True, "features": features})))


def test_settings_that_differ_between_ranks_are_refused_on_every_rank_naming_key_and_values(tmp_path):
    """writer_rank "last" on rank 0 and "first" on rank 1 made no rank the writer (no file, no
    word); per-module norms on one rank counted one rank's shards. Both are refused at start-up."""
    for kind, message, _ in run_ranks(_differing_settings, 2, str(tmp_path), timeout=60):
        assert kind == "ValueError", message
        assert "config key writer_rank differs between ranks ('last' on rank 0; 'first' on rank 1)" in message
        assert "config key log_grad_norm_per_module differs between ranks (False on rank 0; True on rank 1)" in message
        # a timer started with barrier=True waited at a barrier on rank 0 only (level 2 enabled there)
        assert "config key timing_log_level differs between ranks (2 on rank 0; -1 on rank 1)" in message
        assert "config key barrier_with_L1_time differs between ranks (False on rank 0; True on rank 1)" in message
        # each rank finds a loss spike after the reduction by its own factor: health/loss_spike was 1 on one
        # rank and 0 on another, in the dict monitor.step returns (a loop acting on it split)
        assert "config key spike_factor differs between ranks (2.0 on rank 0; 5.0 on rank 1)" in message
        assert "tensor_inspect.features" in message and message.count("spike_factor") == 1
        # each statistic was merged over the ranks that listed the statistics alike: one rank's value
        assert re.search(r"config key tensor_inspect.features differs between ranks \('content \w+' on rank 0; "
                         r"'content \w+' on rank 1\)", message), message
    assert not any(tmp_path.iterdir())  # the claim on output_dir was let go


def _verbosity_on_the_writer_alone(rank: int, world: int, telemetry: bool) -> tuple:
    """Every rank sees a GPU: ``sees_gpu``, the one place the collectors ask torch, answers True (no GPU
    here; the start-up gather that refuses is reached before anything reads the GPU)."""
    import distmetrics as dm
    import distmetrics.collectors as collectors

    collectors.sees_gpu = lambda: True
    config = quiet_config(verbosity=1 if rank == 0 else 0, log_gpu_telemetry=telemetry, log_energy=False)
    return _outcome(lambda: dm.Monitor(config).close())


def test_a_verbosity_that_turns_gpu_telemetry_on_some_ranks_only_is_refused_on_every_rank():
    """verbosity 1 (the console's memory, power and temperature) makes the telemetry collector on a rank
    that sees a GPU: given on the writer alone, gpu/* were the writer's GPU written as the job's hottest."""
    for kind, message, _ in run_ranks(_verbosity_on_the_writer_alone, 2, False, timeout=60):
        assert kind == "ValueError", message
        assert ("config key log_gpu_telemetry differs between ranks ('on: verbosity 1 on a rank that sees a GPU' "
                "on rank 0; False on rank 1)") in message, message
    # log_gpu_telemetry on every rank: verbosity is the writer's console alone again
    assert [kind for kind, _, _ in run_ranks(_verbosity_on_the_writer_alone, 2, True, timeout=60)] == ["ok", "ok"]


def _spike_factor_as_int_or_float(rank: int, world: int) -> float:
    import distmetrics as dm

    # a YAML file's 3 on one rank, an override's 3.0 on another: one spike_factor
    monitor = dm.Monitor(quiet_config(log_interval=1, spike_factor=3 if rank == 0 else 3.0))
    loss = monitor.step(1, loss=2.0)["train/loss"]
    monitor.close()
    return loss


def test_a_shared_float_key_given_as_3_on_one_rank_and_3_0_on_another_agrees():
    assert run_ranks(_spike_factor_as_int_or_float, 2, timeout=60) == [2.0, 2.0]


def _refused_config(rank: int, good: Any) -> Any:
    """``good`` as a mapping, with log_interval 0 on rank 1."""
    return {**good.to_dict(), "log_interval": 0} if rank == 1 else good.to_dict()


def _next_monitor(rank: int, out: dict) -> None:
    """A good Monitor on every rank after the refused ones: the refused rank kept the guards' order."""
    import distmetrics as dm

    def made() -> None:
        monitor = dm.Monitor(quiet_config(log_interval=1, hang_timeout_s=20))
        out["loss"] = monitor.step(1, loss=1.0 + rank, tokens=3)["train/loss"]
        monitor.close()

    out["next"] = _outcome(made)


def _config_refused_on_one_rank(rank: int, world: int) -> dict:
    """Rank 1 gives Monitor() a config it cannot take, rank 0 a good one; then a good one on both."""
    import torch.distributed as dist

    import distmetrics as dm

    good = quiet_config(log_interval=2, hang_timeout_s=20)
    out = {"mapping": _outcome(lambda: dm.Monitor(_refused_config(rank, good)))}
    dist.barrier()
    changed = quiet_config(log_interval=2, hang_timeout_s=20)
    if rank == 1:
        changed.straggler_window = 101  # set after construction: checked by Monitor()
    out["set_after"] = _outcome(lambda: dm.Monitor(changed))
    dist.barrier()
    _next_monitor(rank, out)
    return out


def _config_refused_on_a_group_or_with_the_check_off(rank: int, world: int) -> dict:
    """As above, on a group object other than the world's (no arrival check there), and with
    hang_timeout_s 0 (the start-up call checked once, as another call, where the given value is 0)."""
    import torch.distributed as dist

    import distmetrics as dm

    group = dist.new_group([0, 1])
    out = {"group": _outcome(lambda: dm.Monitor(_refused_config(rank, quiet_config(log_interval=2)), group=group)),
           "check_off": _outcome(lambda: dm.Monitor(_refused_config(rank, quiet_config(hang_timeout_s=0))))}
    _next_monitor(rank, out)
    return out


def _said_on_every_rank(results: list, cases: tuple) -> None:
    """Every rank raised at once the ConfigError the constructor raises, after the rank's name."""
    from distmetrics import ConfigError, MetricsConfig

    truth = {}
    for case, key, value in (("mapping", "log_interval", 0), ("set_after", "straggler_window", 101)):
        with pytest.raises(ConfigError) as refused:  # what the rank raised alone, checked by the constructor
            MetricsConfig(**{key: value})
        truth[case] = str(refused.value)
    assert truth["mapping"] == "log_interval=0: accepted values are integers >= 1"
    truth["group"] = truth["check_off"] = truth["mapping"]
    for rank, out in enumerate(results):
        for case in cases:
            kind, message, seconds = out[case]
            assert (kind, message) == ("ConfigError", f"distmetrics cannot start: rank 1: {truth[case]}"), (rank, case)
            assert seconds < 10, (rank, case, seconds)  # at once, not at hang_timeout_s (20 s)
        assert out["next"][0] == "ok" and out["loss"] == 1.5, out["next"]


def test_a_config_one_rank_cannot_take_is_raised_on_every_rank_at_once_naming_the_rank_and_key():
    """The rank given log_interval=0 (or a field set wrong after construction) raised its ConfigError
    before the start-up gather, alone: the other rank waited hang_timeout_s there, then raised a
    HangError naming rank 1 as one that had not reached Monitor(), the key never named; and the next
    Monitor hung, its arrival check keyed apart on the two ranks."""
    _said_on_every_rank(run_ranks(_config_refused_on_one_rank, 2, timeout=150), ("mapping", "set_after"))


def _config_refused_where_the_others_never_come(rank: int, world: int) -> dict:
    """Rank 0 alone makes a Monitor, with a config it cannot take; rank 1 makes none."""
    import torch.distributed as dist

    out = {}
    if rank == 0:
        import distmetrics as dm

        def refused() -> None:
            try:
                dm.Monitor({**quiet_config().to_dict(), "log_interval": 0, "hang_timeout_s": 3})
            except Exception as err:
                out["cause"] = type(err.__cause__).__name__
                raise

        out["made"] = _outcome(refused)
    dist.barrier()
    return out


def test_a_config_refused_where_the_other_ranks_never_come_is_still_raised_naming_the_key():
    """A refused config on a rank whose peers never make a Monitor: the start-up gather fails (a
    HangError after hang_timeout_s) and that failure was raised in the key's place, naming no key."""
    from distmetrics import ConfigError, MetricsConfig

    with pytest.raises(ConfigError) as alone:
        MetricsConfig(log_interval=0)
    made = run_ranks(_config_refused_where_the_others_never_come, 2, timeout=120)[0]
    assert made["made"][:2] == ("ConfigError", str(alone.value)) and made["cause"] == "HangError", made


def test_a_config_one_rank_cannot_take_is_said_on_a_group_and_with_the_arrival_check_off():
    """On a group without the arrival check the other rank waited in the gather itself (the process
    group's timeout); with hang_timeout_s 0 at the start-up bound."""
    _said_on_every_rank(run_ranks(_config_refused_on_a_group_or_with_the_check_off, 2, timeout=150),
                        ("group", "check_off"))


def _two_writers(rank: int, world: int, root: str) -> dict:
    """writer_rank first on rank 0 and last on rank 1: each took itself for the writer. Then
    log_interval differs while rank 0's own process holds output_dir (a second Monitor there)."""
    import distmetrics as dm
    from distmetrics.output_claim import OutputClaim

    out = {"two": _outcome(lambda: dm.Monitor(quiet_config(output_dir=f"{root}/two", json_log=True,
                                                           writer_rank="first" if rank == 0 else "last")))}
    held = OutputClaim(quiet_config(output_dir=f"{root}/held", json_log=True)) if rank == 0 else None
    out["held"] = _outcome(lambda: dm.Monitor(quiet_config(output_dir=f"{root}/held", json_log=True,
                                                           log_interval=2 + rank)))
    out["pid"] = os.getpid()
    if held is not None:
        held.release()
    return out


def test_a_writer_rank_that_differs_is_said_without_the_output_dir_conflict_it_causes(tmp_path):
    """Both ranks thought they were the writer and claimed output_dir: the one refused added "output_dir
    is in use by another Monitor (pid N ...)", naming a Monitor of the same job. A claim refused for
    another holder is still said beside a shared key that differs."""
    results = run_ranks(_two_writers, 2, str(tmp_path), timeout=90)
    for kind, message, _ in (out["two"] for out in results):
        assert (kind, message) == ("ValueError", "distmetrics cannot start: config key writer_rank differs between "
                                   "ranks ('first' on rank 0; 'last' on rank 1); every rank must be given the same "
                                   "value")
    holder = f"pid {results[0]['pid']} on "
    for kind, message, _ in (out["held"] for out in results):
        assert kind == "ValueError" and message.startswith(
            f"distmetrics cannot start: rank 0: output_dir='{tmp_path}/held' is in use by another Monitor ({holder}"), \
            message
        assert message.endswith("config key log_interval differs between ranks (2 on rank 0; 3 on rank 1); every "
                                "rank must be given the same value"), message
    assert not os.path.exists(tmp_path / "two" / ".distmetrics.lock")  # the claim that was made is let go


def test_a_writer_that_locks_a_lock_file_unlinked_under_it_tries_again(tmp_path, monkeypatch):
    """B opens the lock file while A holds it and is preempted before its flock(); A closes (the
    file is unlinked) and C starts, locking a new file. B's flock then held the unlinked file: B and
    C both wrote output_dir. B now sees the file at the path is not the one it locked and tries
    again: C holds it, B is refused."""
    import distmetrics as dm
    from distmetrics import output_claim

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), console=False, tensorboard=False)
    a = output_claim.OutputClaim(cfg)
    real, claims = output_claim.fcntl.flock, {}

    def preempted(file, operation):
        if not claims:  # B, between its open() and its flock()
            claims["a_released"] = a.release()
            claims["c"] = output_claim.OutputClaim(cfg)
        return real(file, operation)

    monkeypatch.setattr(output_claim.fcntl, "flock", preempted)
    b = output_claim.OutputClaim(cfg)
    c = claims["c"]
    assert c.problem is None and c._held is not None
    assert b._held is None and "is in use by another Monitor" in b.problem
    c.release()


def test_two_monitors_on_one_output_dir_are_refused_until_the_first_closes(tmp_path):
    import distmetrics as dm

    first = dm.Monitor(quiet_config(output_dir=str(tmp_path), json_log=True))
    with pytest.raises(ValueError, match="is in use by another Monitor \\(pid"):
        dm.Monitor(quiet_config(output_dir=str(tmp_path), json_log=True))
    first.close()
    dm.Monitor(quiet_config(output_dir=str(tmp_path), json_log=True)).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_relative_output_dir_stays_the_folder_it_named_when_the_loop_changes_directory(tmp_path, monkeypatch):
    """output_dir="rel" from A, then a chdir to B (a Hydra-style run folder): close() unlinked B/rel's
    lock, held by another running Monitor, and left its own behind; a third Monitor was then let into
    B/rel beside the running one (two writers in one metrics.jsonl). Truth: the folders' listings."""
    import distmetrics as dm

    (tmp_path / "A").mkdir()
    (tmp_path / "B").mkdir()
    running = dm.Monitor(quiet_config(output_dir=str(tmp_path / "B" / "rel"), json_log=True))
    monkeypatch.chdir(tmp_path / "A")
    moved = dm.Monitor(quiet_config(output_dir="rel", json_log=True, log_interval=1))
    monkeypatch.chdir(tmp_path / "B")
    moved.step(1, loss=1.0)
    moved.close()
    assert sorted(p.name for p in (tmp_path / "A" / "rel").iterdir()) == ["metrics.jsonl"]  # its lock let go
    with pytest.raises(ValueError, match="is in use by another Monitor \\(pid"):
        dm.Monitor(quiet_config(output_dir=str(tmp_path / "B" / "rel"), json_log=True))
    running.close()
    assert [r["kind"] for r in dm.read_jsonl(tmp_path / "A" / "rel" / "metrics.jsonl")] == ["run", "train", "end"]
    assert [r["kind"] for r in dm.read_jsonl(tmp_path / "B" / "rel" / "metrics.jsonl")] == ["run", "end"]


def _relative_output_dir_where_a_ranks_cwd_is_gone(rank: int, world: int, root: str) -> list:
    import os

    import distmetrics as dm

    os.makedirs(f"{root}/cwd{rank}")
    os.chdir(f"{root}/cwd{rank}")
    if rank == 1:
        os.rmdir(f"{root}/cwd1")  # this rank's working directory, removed under it
    with dm.Monitor(quiet_config(output_dir="rel", json_log=True, log_interval=1, hang_timeout_s=30)) as monitor:
        monitor.step(1, loss=1.0)
    return []


def test_a_rank_whose_working_directory_is_gone_still_starts_with_a_relative_output_dir(tmp_path):
    """Making a relative output_dir absolute read the working directory on every rank: where a non-writer
    rank's was removed, getcwd raised a bare FileNotFoundError there alone and the writer waited out
    hang_timeout_s. The folder is kept as given there (that rank writes nothing in it)."""
    import distmetrics as dm

    run_ranks(_relative_output_dir_where_a_ranks_cwd_is_gone, 2, str(tmp_path), timeout=120)
    records = dm.read_jsonl(tmp_path / "cwd0" / "rel" / "metrics.jsonl")
    assert [r["kind"] for r in records] == ["run", "train", "end"]


@pytest.mark.parametrize("launcher", [{"WORLD_SIZE": "2", "RANK": "1"},
                                      {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}],
                         ids=["torchrun", "srun"])
def test_a_monitor_before_init_process_group_under_a_launcher_is_refused_or_said(tmp_path, launcher):
    """Under srun the check read WORLD_SIZE only: each task took itself for a 1-rank job, both wrote
    one folder (or one was refused as "in use by another Monitor", naming its sibling), without a word
    on the cause."""
    code = "import distmetrics as dm; dm.Monitor(dm.MetricsConfig(output_dir=%r))" % str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS")}
    run = subprocess.run([sys.executable, "-c", code], env={**env, **launcher},
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    variable = next(iter(launcher))
    assert f"{variable}=2 in the environment but torch.distributed is not initialised" in run.stderr
    if variable == "WORLD_SIZE":  # torchrun's processes are one job: refused, nothing written
        assert run.returncode != 0 and not (tmp_path / "run").exists()
    else:  # srun also starts sweeps of separate jobs: said, not refused
        assert run.returncode == 0 and "separate jobs, give each its own output_dir" in run.stderr
    sbatch = {**env, "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}  # a batch script's one process: not refused
    assert subprocess.run([sys.executable, "-c", code + ".close()"], env=sbatch, capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[1]).returncode == 0


@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_a_monitor_before_init_process_group_under_mpirun_is_said(tmp_path, monkeypatch, caplog, variable):
    """Open MPI's and MPICH's process counts are read as srun's is: said (they also start sweeps of separate
    jobs), not refused; a count of 1 says nothing. In this process, which has no process group."""
    import distmetrics as dm

    for name in ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for count, said in (("4", 1), ("1", 0)):
        monkeypatch.setenv(variable, count)
        caplog.clear()
        dm.Monitor(quiet_config(output_dir=str(tmp_path / count))).close()
        warned = [r.getMessage() for r in caplog.records if "torch.distributed is not initialised" in r.getMessage()]
        assert len(warned) == said, warned
        if said:
            assert warned[0].startswith(f"distmetrics: {variable}=4 in the environment but torch.distributed is not "
                                        "initialised") and "give each its own output_dir" in warned[0], warned


# --- bad arguments: refused before anything is recorded ------------------------------------------

def _monitor(tmp_path, **extra):
    import distmetrics as dm

    return dm.Monitor(quiet_config(output_dir=str(tmp_path), json_log=True, log_interval=4, **extra))


def test_an_integer_beyond_float64_is_refused_naming_the_argument_and_the_step_can_be_retried(tmp_path):
    """loss=10**400 passed the check and raised a bare OverflowError ("int too large to convert to
    float") inside the step, after the step number was taken: the retry was refused as not
    increasing. In a collector's Sample it failed inside the pack, after the other ranks had
    entered the collective."""
    import distmetrics as dm

    monitor = _monitor(tmp_path)
    for kwargs, what in (({"loss": 10**400}, "loss"), ({"lr": -10**400}, "lr"), ({"tokens": 10**400}, "tokens"),
                         ({"acc": 10**400}, "acc")):
        with pytest.raises(ValueError, match=f"monitor.step\\({what}=...\\): -?10000000000.*digits.* beyond float64"):
            monitor.step(1, **kwargs)
    with pytest.raises(ValueError, match="monitor.record\\('x'\\): 100000000000... \\(401 digits\\) is beyond"):
        monitor.record("x", 10**400)
    import numpy as np  # a finite longdouble past float64's range was written as Infinity without a word

    for record in (lambda: monitor.record("x", np.longdouble("1e400")),
                   lambda: monitor.step(1, acc=-np.longdouble("1e400"))):
        with pytest.raises(ValueError, match="-?1e\\+400.* is beyond float64's range"):
            record()
    monitor.record("x_inf", np.longdouble("inf"))  # inf is a value as any other
    for step in (1, 2, 3, 4):
        monitor.step(step, loss=1.0)
    monitor.close()
    (record,) = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert record["step"] == 4 and record["train/loss"] == 1.0 and "x" not in record
    assert record["x_inf"] == float("inf")


def test_numpy_numbers_are_taken_as_the_numbers_they_hold(tmp_path):
    """np.float64 was accepted (a float subclass) but np.float32 and np.int64, which numpy code and
    ``tensor.numpy()[0]`` hand over, were refused as "expected a number"."""
    import numpy as np

    import distmetrics as dm

    monitor = _monitor(tmp_path, log_throughput=True)
    for step in (1, 2, 3, 4):
        monitor.record("acc", np.float32(0.25 * step), reduce="max")
        monitor.step(step, loss=np.float32(step), tokens=np.int64(10 * step), lr=np.float32(0.5), width=np.int16(3))
    monitor.close()
    (record,) = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert record["train/loss"] == (1 * 10 + 2 * 20 + 3 * 30 + 4 * 40) / 100  # token-weighted
    assert record["train/consumed_tokens"] == 100 and record["train/lr"] == 0.5
    assert record["acc"] == 1.0 and record["train/width"] == 3.0


@pytest.mark.parametrize("call,error,message", [
    (lambda m, t: m.timers("x", "1"), "TimerError",
     "timers('x', log_level='1'): accepted values are numbers up to 2, compared with timing_log_level as Megatron"),
    (lambda m, t: m.record_losses([1.0, 2.0], ["a", "b"]), "TypeError",
     "record_losses(per_sample_loss=...): expected a tensor of per-sample losses (reduction='none'), got list"),
    (lambda m, t: m.record_losses(t.ones(2), t.tensor([0.5, 1.7]), names=["a", "b"]), "TypeError",
     "record_losses(categories=...): a tensor of categories holds integer ids, got torch.float32"),
    (lambda m, t: m.record_losses(t.ones(2), ["", "b"]), "ValueError",
     "record_losses: category '': metric name 'train/loss/' is refused"),
    (lambda m, t: m.record_losses(t.ones(1), ["\ud800"]), "ValueError", "is not valid UTF-8"),
    (lambda m, t: m.step(1, loss=t.ones(1).to_sparse()), "ValueError",
     "monitor.step(loss=...): expected a dense tensor, got a torch.sparse_coo one"),
    (lambda m, t: m.step(1, loss=__import__("fractions").Fraction(10**400)), "ValueError",
     "monitor.step(loss=...): Fraction(100000000000000... (414 characters) is beyond float64's range"),
], ids=["timer log level as text", "losses as a list", "float category ids", "empty category", "surrogate category",
        "sparse loss", "a fraction beyond float64"])
def test_arguments_of_the_wrong_kind_are_named_with_what_is_accepted(call, error, message):
    """Each raised an error from deep inside (''<' not supported between int and str', ''list' object
    has no attribute 'detach''), or was taken: float ids cut to integers, a category '' written as
    'train/loss/', a surrogate that TensorBoard then skipped."""
    import torch

    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=1, timing_log_level=0)) as monitor:
        with pytest.raises(Exception, match=re.escape(message)) as raised:
            call(monitor, torch)
        assert type(raised.value).__name__ == error
        assert not any(k.startswith("train/loss/") for k in monitor.step(1))


class _ClassCollector:
    name, after, writes = "data", (), ("data/",)

    def take_samples(self, ctx):
        return []

    def finalize(self, metrics, ctx):
        return []

    def close(self):
        pass


@pytest.mark.parametrize("kwargs,message", [
    ({"collectors": [object()]}, "is not a collector: it lacks a name (a non-empty str), take_samples(), finalize(), "
                                 "close()"),
    ({"collectors": "abc"}, "Monitor(collectors=...): expected a list or tuple of collectors, got str 'abc'"),
    # a class whose name, methods and writes are class attributes passed, and every log step then failed
    ({"collectors": [_ClassCollector]}, "Monitor(collectors=...): _ClassCollector is a class, not a collector; "
                                        "give an instance of it (_ClassCollector(...))"),
    ({"device_mesh": "cpu"}, "device_mesh: expected a torch DeviceMesh (init_device_mesh(...)), got str 'cpu'"),
])
def test_a_monitor_given_something_else_than_a_collector_or_a_mesh_says_what_it_takes(kwargs, message):
    """AttributeErrors about 'name' and 'mesh_dim_names'."""
    import distmetrics as dm

    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        dm.Monitor(quiet_config(), **kwargs)


def test_a_refused_step_records_nothing_and_can_be_retried(tmp_path):
    import distmetrics as dm

    monitor = _monitor(tmp_path)
    monitor.step(1, loss=1.0)
    with pytest.raises(TypeError, match="monitor.step\\(lr=...\\): expected a number"):
        monitor.step(2, loss=100.0, lr="bad")
    monitor.step(2, loss=1.0)  # the retry is accepted
    for step in (3, 4):
        monitor.step(step, loss=1.0)
    monitor.close()
    record = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"][-1]
    assert record["step"] == 4 and record["train/loss"] == 1.0  # the refused loss=100 is not in it


@pytest.mark.parametrize("calls,message", [
    ([("step", {"loss": 1.0, "train/loss": 5.0})], "'train/loss', which monitor.step\\(loss=...\\) writes already"),
    ([("record", ("x", 1.0, "minmax")), ("record", ("x/max", 2.0, "sum"))], "would write 'x/max', which"),
    ([("record", ("y", 1.0, "max")), ("record", ("y/max_rank", 2.0, "sum"))], "would write 'y/max_rank', which"),
    ([("record", ("z", 1.0, "all")), ("record", ("z/rank0", 2.0, "sum"))], "for a rank of the 'all' metric 'z'"),
    ([("record", ("_hidden", 1.0, "mean"))], "do not start with '_'"),
    ([("record", ("lone\ud800", 1.0, "mean"))], "not valid UTF-8"),
])
def test_names_that_would_collide_or_vanish_are_refused_at_the_call(tmp_path, calls, message):
    monitor = _monitor(tmp_path)
    with pytest.raises(ValueError, match=message):
        for verb, arguments in calls:
            if verb == "step":
                monitor.step(1, **arguments)
            else:
                monitor.record(*arguments)
    monitor.close()


def test_a_name_that_is_not_a_string_and_a_step_beyond_int64_are_refused(tmp_path):
    monitor = _monitor(tmp_path)
    with pytest.raises(TypeError, match="a metric name is a str, got int 123"):
        monitor.record(123, 1.0)
    with pytest.raises(ValueError, match="accepted values are Python ints from 0 to 2\\*\\*63 - 1"):
        monitor.step(2 ** 63)
    monitor.close()


@pytest.mark.parametrize("arguments,error,message", [
    ({"loss": "tensor2"}, ValueError, "monitor.log_eval\\(loss=...\\): expected a number or a 1-element tensor, got a tensor"),
    ({"tokens": "many"}, TypeError, "monitor.log_eval\\(tokens=...\\): expected a number"),
    ({"acc": "a"}, TypeError, "monitor.log_eval\\(acc=...\\): expected a number or a 1-element tensor, got str 'a'"),
    ({"_eval/tokens": 5.0}, ValueError, "metric name '_eval/tokens' is refused"),
    ({"eval/ppl": 5.0}, ValueError, "would write 'eval/ppl', which monitor.log_eval writes already"),
    ({"loss/web": 5.0}, ValueError, "metric 'loss/web' is written in train records already"),
    ({"eval/loss/web": 5.0}, ValueError, "would write 'eval/loss/web', which monitor.log_eval writes already"),
    ({"train/loss": 5.0}, ValueError, "would write 'train/loss', which monitor.step\\(loss=...\\) writes already"),
])
def test_a_refused_log_eval_changes_nothing_and_can_be_retried(tmp_path, arguments, error, message):
    import torch

    monitor = _monitor(tmp_path)
    monitor.record("loss/web", 1.0, "sum")  # claimed by monitor.record first
    monitor.record_losses(torch.tensor([1.0, 3.0]), ["web", "web"], split="eval")
    arguments = {"loss": 2.0, **{k: torch.ones(2) if v == "tensor2" else v for k, v in arguments.items()}}
    with pytest.raises(error, match=message):
        monitor.log_eval(1, **arguments)
    metrics = monitor.log_eval(1, loss=2.0, tokens=10)  # the retry keeps the refused call's categories
    monitor.close()
    assert metrics["eval/loss"] == 2.0 and metrics["eval/loss/web"] == 2.0


def _refused_then_retried(rank: int, world: int) -> dict:
    """Calls refused at the call on both ranks, each retried as it should have been made."""
    import torch

    import distmetrics as dm

    out = {}
    monitor = dm.Monitor(quiet_config(log_interval=1, hang_timeout_s=TIMEOUT_S))
    out["step twice"] = _outcome(lambda: monitor.step(1, loss=1.0, acc=1.0, **{"train/acc": 3.0}))
    out["record bad value"] = _outcome(lambda: monitor.record("x", "bad"))
    out["record bad weight"] = _outcome(lambda: monitor.record("z", 1.0, weight=-1))
    out["retries"] = _outcome(lambda: (monitor.record("x", 1.0 + rank, reduce="max"),  # another kind than mean
                                       monitor.record("z", 2.0, reduce="sum")))
    train = monitor.step(1 + (out["step twice"][0] == "ok"), loss=1.0, acc=1.0 + rank)
    out["train"] = {k: train.get(k) for k in ("train/acc", "x", "x/max_rank", "z")}
    monitor.record_losses(torch.tensor([1.0, 3.0 + rank]), ["web", "web"], split="eval")
    out["eval twice"] = _outcome(lambda: monitor.log_eval(3, loss=2.0, acc2=1.0, **{"eval/acc2": 5.0}))
    out["eval"] = monitor.log_eval(4, loss=2.0, acc2=1.0 + rank)
    monitor.close()
    return out


@pytest.fixture(scope="module")
def refused_then_retried():
    return run_ranks(_refused_then_retried, 2, timeout=120)


def test_a_metric_given_in_both_spellings_is_refused_at_the_call(refused_then_retried):
    """monitor.step(acc=1, **{"train/acc": 3}) wrote one train/acc of 2.0, the mean of both, without
    a word; log_eval(acc2=..., **{"eval/acc2": ...}) raised "appear twice in one reduction" from
    inside the reduction. Both are refused at the call, naming both spellings, on every rank."""
    for out in refused_then_retried:
        kind, message, _ = out["step twice"]
        assert kind == "ValueError" and message.startswith(
            "monitor.step(acc=..., train/acc=...): both name the metric 'train/acc'"), message
        kind, message, _ = out["eval twice"]
        assert kind == "ValueError" and message.startswith(
            "monitor.log_eval(acc2=..., eval/acc2=...): both name the metric 'eval/acc2'"), message
        assert out["train"]["train/acc"] == 1.5 and out["eval"]["eval/acc2"] == 1.5  # the retries: 1 and 2


def test_a_refused_log_eval_keeps_the_eval_loss_categories(refused_then_retried):
    """The refused log_eval took the eval categories recorded for it, then raised: the retry's record
    had no eval/loss/web. A refused call changes nothing."""
    for out in refused_then_retried:
        assert out["eval"]["eval/loss/web"] == (1.0 + 3.0 + 1.0 + 4.0) / 4


def test_a_refused_record_claims_no_name(refused_then_retried):
    """record("x", "bad") claimed x as a mean before its value was refused, so the retry
    record("x", 1.0, reduce="max") was refused too ("recorded as 'mean' before"); the same for a
    weight refused. The value and the weight are checked first."""
    for out in refused_then_retried:
        assert out["record bad value"][:2] == ("TypeError", "monitor.record('x'): expected a number or a 1-element "
                                               "tensor, got str 'bad'")
        assert out["record bad weight"][0] == "ValueError" and "-1 is refused" in out["record bad weight"][1]
        assert out["retries"][0] == "ok", out["retries"]
        assert out["train"]["x"] == 2.0 and out["train"]["x/max_rank"] == 1 and out["train"]["z"] == 4.0


def test_a_scalar_given_as_none_is_a_step_without_that_value():
    """Accepted by the argument check, so it must not fail halfway through recording (before, the
    step raised after its loss was recorded, and the loss counted although the call was refused)."""
    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=2))
    monitor.step(1, loss=5.0, acc=None)
    metrics = monitor.step(2, loss=1.0, acc=2.0)
    monitor.close()
    assert metrics["train/loss"] == 3.0 and metrics["train/acc"] == 2.0

def test_a_log_eval_step_that_no_lane_can_hold_is_refused(tmp_path):
    monitor = _monitor(tmp_path)
    with pytest.raises(ValueError, match="monitor.log_eval: step='1': accepted values are Python ints from 0"):
        monitor.log_eval("1", loss=2.0)
    monitor.close()


@pytest.mark.parametrize("name,kind,writer", [
    ("memory/host_rss_gib", "max", "the 'memory' collector"),
    ("stragglers/score_min", "mean", "the '(timers|stragglers)' collector"),  # both write under stragglers/
    ("train/loss/web", "mean", "the 'losses' collector"),
    ("train/tokens_per_sec", "mean", "the 'throughput' collector"),
    ("eval/tokens_per_sec", "mean", "monitor.log_eval"),
])
def test_a_name_a_collector_writes_is_refused_at_the_call_and_the_log_step_goes_on(tmp_path, name, kind, writer):
    """Without the check, ``memory/host_rss_gib`` fails the next log step after every collector
    handed over its interval (the interval is lost), and ``stragglers/score_min`` is overwritten."""
    monitor = _monitor(tmp_path, log_memory=True, log_throughput=True, straggler_window=2)
    for step in (1, 2, 3):
        monitor.step(step, loss=1.0)
    with pytest.raises(ValueError, match=f"would write '{name}', which {writer} writes already"):
        monitor.record(name, 5.0, kind)
    with pytest.raises(ValueError, match=f"would write '{name}', which {writer} writes already"):
        monitor.step(4, loss=1.0, **{name: 5.0})
    metrics = monitor.step(4, loss=2.0)
    monitor.close()
    assert metrics["train/loss"] == 1.25 and metrics.get(name) != 5.0
    assert metrics["memory/host_rss_gib"] > 0 and not any(k.startswith("stragglers/score") for k in metrics)  # one rank


def test_a_monitor_that_cannot_be_made_lets_go_of_its_output_dir(tmp_path):
    import distmetrics as dm

    class Memory(_Probe):
        name = "memory"

    with pytest.raises(ValueError, match="a collector of yours is named 'memory', the name of a built-in") as refused:
        dm.Monitor(quiet_config(output_dir=str(tmp_path), json_log=True, log_memory=True), collectors=[Memory(0)])
    # the retry runs while the error's traceback (and the half-made Monitor in it) is alive, as in an
    # `except` block; without the release: "output_dir=... is in use by another Monitor"
    dm.Monitor(quiet_config(output_dir=str(tmp_path), json_log=True)).close()
    assert refused.value is not None and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    with pytest.raises(ValueError, match="a collector of yours is named 'memory', the name of a built-in"):
        dm.Monitor(quiet_config(log_memory=False), collectors=[Memory(0)])  # reserved with its switch off too


def test_calls_between_log_steps_reach_the_store_about_a_thousand_times_a_second_in_all():
    """At 4,096 ranks each rank publishes its latest call every 4.1 s, not every second. The guard
    is given a real in-process store and told the world is 4,096 ranks (this machine has 2 cores)."""
    import torch.distributed as dist

    from distmetrics.guard import CollectiveGuard

    guard = CollectiveGuard(TIMEOUT_S)  # no process group: off until given a store
    guard.store, guard.world, guard.rank = dist.HashStore(), 4096, 7
    assert guard.publish_every_s == pytest.approx(4.096)
    guard.note("monitor.step", 1)
    time.sleep(1.2)
    guard.note("monitor.step", 2)
    assert guard.store.get("rank7").decode().split("|")[1] == "monitor.step(step=1)"
    guard.world = 2  # a small job: once a second, as before
    guard.note("monitor.step", 3)
    assert guard.store.get("rank7").decode().split("|")[1] == "monitor.step(step=3)"


# --- OutputClaim gives up --------------------------------------------------------------------
# OutputClaim when the lock file is unlinked under it at every try: it gives up after
# ``_LOCK_TRIES`` tries and Monitor() refuses to start, naming output_dir.

def test_a_lock_file_unlinked_at_every_try_gives_up_naming_output_dir(tmp_path, monkeypatch):
    """Real files in tmp_path; only ``fcntl.flock`` as output_claim calls it is replaced, by a wrapper
    that unlinks the lock file (a closing Monitor's release()) between the open() and the real
    flock() — the race of a writer that keeps restarting there — and then calls the real flock."""
    import distmetrics as dm
    from distmetrics import output_claim

    out = tmp_path / "job 7" / "metrics"
    lock = out / ".distmetrics.lock"
    real, tries = output_claim.fcntl.flock, []

    def unlinked_first(file, operation):
        tries.append(operation)
        lock.unlink()  # the file this try opened is gone from the path before it is locked
        return real(file, operation)

    monkeypatch.setattr(output_claim.fcntl, "flock", unlinked_first)
    with pytest.raises(ValueError) as err:
        dm.Monitor(quiet_config(output_dir=str(out), json_log=True))
    assert f"output_dir={str(out)!r} is in use by other Monitors starting there at the same time" in str(err.value)
    assert len(tries) == output_claim._LOCK_TRIES  # it gave up, after every try
    assert not lock.exists() and not (out / "metrics.jsonl").exists()  # it wrote nothing there

    monkeypatch.undo()  # the race is over: nothing was left holding output_dir
    dm.Monitor(quiet_config(output_dir=str(out), json_log=True)).close()


def _skipped_step(rank: int, world: int, timeout: float, root: str) -> dict:
    import torch

    import distmetrics as dm

    features = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "fc$"},
                      "distmetrics": {"LogTensorStats": {"enabled": True, "tensors": ["activation"], "stats": ["mean"],
                                                         "freq": 2}}}}
    out = {}
    for case in ("train", "tensor_stats"):
        model = torch.nn.Sequential()
        model.add_module("fc", torch.nn.Linear(2, 2))
        inspect = {"enabled": True, "features": features, "log_dir": f"{root}/rank{rank}"} \
            if case == "tensor_stats" else {"enabled": False}
        monitor = dm.Monitor(quiet_config(log_interval=2 if case == "train" else 100, hang_timeout_s=timeout,
                                          tensor_inspect=inspect), model=model)

        def run():
            for step in (1, 2, 3, 4, 5, 6):
                if step == 3 and rank == 1:
                    continue  # this rank's loop skipped one monitor.step (the others made it)
                model(torch.full((1, 2), float(step + 50 * rank))).sum().backward()
                monitor.step(step, loss=float(step), tokens=100)

        out[case] = _outcome(run)
        monitor._shutdown()  # no close(): its collective would meet a rank that raised elsewhere
    return out


@pytest.mark.parametrize("timeout", [0.0, 60.0], ids=["arrival check off", "arrival check on"])
def test_a_rank_that_skips_a_monitor_step_raises_on_every_rank(timeout, tmp_path):
    """Rank 1 skips step 3 (log_interval 2). Its step 4 record went through with the mean of the
    three steps it made, a consumed_tokens of 700, and a different step time on each rank; with
    tensor statistics every later record mixed rank 0's step s with rank 1's step s + 1 (means 70
    for 53). Both now raise, naming what differs: with the arrival check, as soon as both arrive
    (they waited all of hang_timeout_s at two different counters before)."""
    results = run_ranks(_skipped_step, 2, timeout, str(tmp_path), timeout=150)
    for rank, out in enumerate(results):
        kind, message, _ = out["train"]
        assert kind == "RuntimeError" and "different numbers of monitor.step calls before the log step of step 4: " \
            f"1 on rank 1 and 2 on rank 0 (this rank: {2 - rank})" in message, (rank, kind, message)  # who, not what
        kind, message, seconds = out["tensor_stats"]  # the statistics of step 3 on rank 0 meet step 4's on rank 1
        if timeout:
            assert kind == "HangError" and "where the ranks made different calls: monitor.step (tensor statistics)" \
                "(step=3) on rank 0; monitor.step (tensor statistics)(step=4) on rank 1" in message, message
            assert seconds < timeout / 2, (seconds, message)  # at once, not at hang_timeout_s
        else:
            assert kind == "RuntimeError" and "out of step" in message and "at step 3 on rank 0 and step 4 on rank 1" \
                in message, message


# --- arguments refused at the call, and what a raising log step leaves -----------------------------
def _meta_value_on_one_rank(rank: int, world: int) -> dict:
    import torch

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=10))
    monitor.step(1, loss=1.0)
    out = {}
    if rank == 1:
        out["meta"] = _outcome(lambda: monitor.step(2, loss=torch.ones((), device="meta")))
    out["step 2"] = _outcome(lambda: monitor.step(2, loss=1.0))  # the refused call changed nothing: made again
    monitor.close()
    return out


def test_a_value_on_the_meta_device_is_refused_at_the_call_before_any_collective():
    """Accepted at the call, it failed inside the SUM pack after the MAX all-reduce: rank 0 waited
    in the next collective with no message, and rank 1's step 2 could not be made again."""
    results = run_ranks(_meta_value_on_one_rank, 2, timeout=90)
    kind, message, _ = results[1]["meta"]
    assert kind == "ValueError" and "meta device holds no value" in message, message
    assert results[0]["step 2"][0] == "ok" and results[1]["step 2"][0] == "ok"


def _after_a_raising_log_step(rank: int, world: int, root: str) -> list:
    import distmetrics as dm
    from tests.dist_utils import FakeClock

    seen = []
    with FakeClock() as clock:
        monitor = dm.Monitor(quiet_config(log_interval=2, timing_log_level=1, hang_timeout_s=30, output_dir=root,
                                          json_log=True, log_throughput=True))
        for step in range(1, 7):
            with monitor.timers("fwd", log_level=1):
                clock.advance(10.0)
            if step == 2:  # the README's ValueError on every rank, caught by the loop
                monitor.record("x", 1.0, reduce="sum" if rank == 0 else "mean")
            try:
                metrics = monitor.step(step, loss=1.0, tokens=100)
                if metrics:
                    seen.append((step, metrics["timers/fwd"]))
            except ValueError:
                seen.append((step, "ValueError"))
        monitor.close()
    return seen


def test_a_log_step_that_raised_leaves_the_next_interval_whole(tmp_path):
    """The collectors had started a new interval when the reduction raised, but the Monitor's
    count of the interval's steps was reset only after it: the next interval's timers were
    divided by 4 steps for 2 (timers/fwd 5 ms for 10). And the interval of the name reduced two
    ways was lost whole: no record of step 2, its tokens never counted (consumed tokens 800 at
    step 6 for 1,200). Now the name alone is left out of that record, which is written."""
    import distmetrics as dm

    for seen in run_ranks(_after_a_raising_log_step, 2, str(tmp_path), timeout=90):
        assert seen == [(2, "ValueError"), (4, 10.0), (6, 10.0)], seen
    train = {r["step"]: r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"}
    assert sorted(train) == [2, 4, 6] and "x" not in train[2] and train[2]["train/loss"] == 1.0
    assert train[6]["train/consumed_tokens"] == 1200


def test_checkpoint_saved_refuses_a_step_that_is_not_a_step(tmp_path):
    """None and "2" were written as "step": null / "2" in metrics.jsonl and "Iteration: None" in
    progress.txt."""
    import distmetrics as dm

    with dm.Monitor(quiet_config(output_dir=str(tmp_path), json_log=True, log_progress=True)) as monitor:
        for step in (None, "2", -1):
            with pytest.raises(ValueError, match=r"monitor.checkpoint_saved: step=.*accepted values are Python ints"):
                monitor.checkpoint_saved(step)
    assert "Iteration" not in (tmp_path / "progress.txt").read_text()


def test_a_users_sink_without_a_name_fails_alone_and_a_thing_that_is_no_sink_is_refused(tmp_path, caplog):
    """A sink without ``name`` whose log raised made the failure handler raise in turn: every sink
    after it received nothing. Monitor(sinks="jsonl") was accepted."""
    import logging

    import distmetrics as dm

    class Broken:
        def log(self, metrics, step, kind):
            raise RuntimeError("boom")

        def close(self):
            pass

    class Counting:
        name, fix = "counting", ""

        def __init__(self):
            self.seen = []

        def log(self, metrics, step, kind):
            self.seen.append((kind, step))

        def close(self):
            pass

    caplog.set_level(logging.WARNING, logger="distmetrics")
    good = Counting()
    with dm.Monitor(quiet_config(output_dir=str(tmp_path), log_interval=1), sinks=[Broken(), good]) as monitor:
        for step in (1, 2, 3):
            monitor.step(step, loss=1.0)
    assert [k for k, _ in good.seen].count("train") == 3
    assert any("the Broken sink failed (RuntimeError: boom)" in r.getMessage() for r in caplog.records)
    for bad in ("jsonl", [object()]):
        with pytest.raises(ValueError, match=r"Monitor\(sinks=...\)"):
            dm.Monitor(quiet_config(output_dir=str(tmp_path / "x")), sinks=bad)


@pytest.mark.parametrize("call", ["step tokens", "record weight", "log_eval tokens", "log_eval time_ms"])
@pytest.mark.parametrize("value", [-5, float("nan"), float("inf"), "numpy -5"], ids=["negative", "nan", "inf", "numpy"])
def test_a_count_or_weight_that_is_negative_or_not_finite_is_refused_at_the_call(call, value):
    """tokens 10 then -5 gave train/loss -1.0 for losses 1 and 3, and tokens/s -4.7e4; NaN tokens
    made train/loss NaN with health/nonfinite_loss 0; log_eval(time_ms=-5) a negative eval
    throughput. A refused call changes nothing: the step is made again with a good value."""
    import numpy as np

    import distmetrics as dm

    value = np.float64(-5.0) if value == "numpy -5" else value
    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        calls = {"step tokens": (lambda v: monitor.step(1, loss=1.0, tokens=v)),
                 "record weight": (lambda v: monitor.record("x", 1.0, weight=v)),
                 "log_eval tokens": (lambda v: monitor.log_eval(1, loss=1.0, tokens=v)),
                 "log_eval time_ms": (lambda v: monitor.log_eval(1, loss=1.0, time_ms=v))}
        with pytest.raises(ValueError, match="is refused: accepted values are finite numbers >= 0"):
            calls[call](value)
        calls[call](10)


def test_small_surprises_at_the_edges_are_named(tmp_path):
    """measure_grad_norms(step="2") said "not all arguments converted during string formatting";
    clip_grad_norm_(np.float32(1.0)) said "missing 1 required argument: 'max_norm'"; an eval loss
    of 800 gave a perplexity of e^700 (it overflows: inf); check-config of a folder said "does
    not exist"; report of a record with step 1e400 ended in an OverflowError traceback."""
    import json
    import math

    import numpy as np
    import torch

    import distmetrics as dm
    from tests.dist_utils import run_python

    model = torch.nn.Linear(3, 1)
    model(torch.ones(2, 3)).sum().backward()
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        with pytest.raises(ValueError, match=r"monitor.measure_grad_norms: step='2': accepted values are Python ints"):
            monitor.measure_grad_norms(step="2")
        expected = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()]).norm()
        assert float(monitor.clip_grad_norm_(np.float32(1e9))) == pytest.approx(float(expected))
        assert monitor.log_eval(1, loss=800.0)["eval/ppl"] == math.inf
        assert math.isnan(monitor.log_eval(3, loss=math.nan)["eval/ppl"])
        assert monitor.log_eval(2, loss=3.0)["eval/ppl"] == pytest.approx(math.exp(3.0))
    checked = run_python("-m", "distmetrics.cli", "check-config", tmp_path)
    assert checked.returncode == 2 and "is a folder; give the YAML file" in checked.stderr, checked.stderr
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "run", "step": 0}) + "\n" +
                                       '{"kind": "train", "step": 1e400, "train/loss": 1.0}\n' +
                                       json.dumps({"kind": "train", "step": 2, "train/loss": 1.0}) + "\n")
    pytest.importorskip("matplotlib")
    report = run_python("-m", "distmetrics.cli", "report", run)
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stderr[-2000:]


def _one_rank_missing_two_waiting(rank: int, world: int) -> tuple:
    """Rank 2 never reaches the log step at 4 (it raises later); rank 1 arrives there at once and
    rank 0 1 s later: rank 1 times out first and leaves its Monitor on that HangError."""
    import distmetrics as dm

    def run():
        with dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=2.0)) as monitor:
            for step in (1, 2, 3, 4):
                if step == 3 and rank == 2:
                    time.sleep(5)  # past rank 0's time-out (3 s) with room on a loaded machine
                    raise KeyError("late")
                if step == 4 and rank == 0:
                    time.sleep(1.0)
                monitor.step(step, loss=1.0)
    return _outcome(run)


def test_a_rank_that_arrived_and_left_on_its_own_hang_error_is_not_named_as_missing():
    """Rank 1 arrived, timed out and left; rank 0, timing out after it, named rank 1 among the ranks
    that did not arrive (its "left its Monitor on HangError, after monitor.step(step=4)")."""
    outcomes = run_ranks(_one_rank_missing_two_waiting, 3, timeout=120)
    for rank in (0, 1):
        kind, message, _ = outcomes[rank]
        assert kind == "HangError" and "rank 2: last call monitor.step(step=2)" in message, message
        assert "rank 1:" not in message and "rank 0:" not in message, message


def _one_rank_leaves(rank: int, world: int, how: str) -> tuple:
    """Rank 1 closes its Monitor after the log step at 2 (nothing left to write: no collective), or
    leaves it on an error at step 3; rank 0 goes on to the log step at 4."""
    import distmetrics as dm

    def run():
        with dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=120.0)) as monitor:
            for step in (1, 2, 3, 4):
                if rank == 1 and step == 3:
                    if how == "close":
                        monitor.close()
                        return
                    raise KeyError("the loop's own error")
                monitor.step(step, loss=1.0)
    return _outcome(run)


@pytest.mark.parametrize("how,said", [("close", "closed its Monitor"), ("error", "left its Monitor on KeyError")])
def test_a_rank_waiting_for_one_that_left_its_monitor_says_so(how, said):
    """The waiting rank named the leaver's last published call (monitor.step(step=2)), not that it had
    closed its Monitor or left it on an error; and it waited all of hang_timeout_s (300 s by default)
    for a rank whose leaving it could read in the store."""
    kind, message, _ = run_ranks(_one_rank_leaves, 2, how, timeout=240)[0]
    assert kind == "HangError" and f"rank 1: last call {said}, after monitor.step(step=2)" in message, message
    waited = float(re.search(r"waited ([0-9.]+) s \(of hang_timeout_s 120: a rank has left its Monitor\)",
                             message).group(1))
    assert waited < 60, message  # it saw the rank leave: not the 120 s of hang_timeout_s


def _two_leave_one_late(rank: int, world: int) -> tuple:
    """Rank 2 closes its Monitor and rank 3 leaves it on an error, both at step 3; rank 0 goes on to the
    log step at 4 once both have left, and raises there; rank 1 comes to it only after rank 0 has raised
    (each told through the store, so the order holds on a loaded machine), and rank 0 stays up (it hosts
    the store) until rank 1 has raised."""
    from datetime import timedelta

    import torch.distributed as dist

    import distmetrics as dm

    store = dist.PrefixStore("test/two_leave_one_late/", dist.distributed_c10d._get_default_store())

    def run():
        with dm.Monitor(quiet_config(log_interval=2, hang_timeout_s=120.0)) as monitor:
            for step in (1, 2, 3, 4):
                if step == 3 and rank == 2:
                    monitor.close()
                    return
                if step == 3 and rank == 3:
                    raise KeyError("the loop's own error")
                if step == 4:
                    after = ["rank 2 left", "rank 3 left"] if rank == 0 else ["rank 0 raised"]
                    store.wait(after, timedelta(seconds=60))
                monitor.step(step, loss=1.0)
    outcome = _outcome(run)
    if rank in (2, 3):
        store.set(f"rank {rank} left", "1")
    elif rank == 0:
        store.set("rank 0 raised", "1")
        store.wait(["rank 1 raised"], timedelta(seconds=60))
    elif rank == 1:
        store.set("rank 1 raised", "1")
    return outcome


def _named(message: str, group: str) -> dict:
    """The ranks a HangError names in ``group`` ("left" or "not arrived"), with what it says of each."""
    found = re.search(r"ranks that left their Monitor and will not arrive: (.*?); ranks that did not arrive yet: "
                      r"(.*?)\. Every rank", message)
    assert found, message
    listed = found.group(1 if group == "left" else 2)
    return {int(r): said for r, said in re.findall(r"rank (\d+): last call (.*?) \(published", listed)}


def test_a_hang_error_names_the_ranks_that_left_apart_from_the_ranks_still_on_their_way():
    """Rank 0, at the log step where ranks 2 and 3 had left their Monitors and rank 1 was still on its
    way, listed all three alike as ranks that did not arrive after "a rank has left its Monitor": the
    healthy rank 1 read as one that had left. Each rank that raises now names the two that left (how,
    after which call) and, apart, the ranks that had not arrived yet."""
    outcomes = run_ranks(_two_leave_one_late, 4, timeout=120)
    assert outcomes[2][0] == "ok" and outcomes[3][0] == "KeyError", outcomes
    left = {2: "closed its Monitor, after monitor.step(step=2)",
            3: "left its Monitor on KeyError, after monitor.step(step=2)"}
    for rank, late in ((0, [1]), (1, [])):  # rank 0 had arrived (and left on its HangError) before rank 1 came
        kind, message, seconds = outcomes[rank]
        assert kind == "HangError" and "a rank has left its Monitor" in message, (rank, kind, message)
        assert _named(message, "left") == left, message
        assert sorted(_named(message, "not arrived")) == late, message
        assert late or "ranks that did not arrive yet: none." in message, message
        assert seconds < 60, message  # at once, not at hang_timeout_s (120 s)


@pytest.mark.parametrize("how", ["never closed", "closed", "in a function"])
def test_a_process_ending_with_its_monitor_open_says_what_is_not_written(tmp_path, how):
    """A script that never called close() lost the steps after its last log step without a word (the
    writer thread's exit hook writes the records made, but the unfinished interval needs a collective);
    a Monitor left open in a function is said when it is collected."""
    code = ("import distmetrics as dm\ndef main():\n    m = dm.Monitor(dm.MetricsConfig(output_dir=%r, log_interval=2, "
            "console=False, tensorboard=False, timing_log_level=-1))\n    for s in (1, 2, 3):\n        m.step(s, "
            "loss=1.0)\n%s    return m\n%s" % (str(tmp_path), "    m.close()\n" if how == "closed" else "",
                                              "main()" if how == "in a function" else "m = main()"))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "SLURM_STEP_NUM_TASKS")}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr
    import distmetrics as dm

    steps = [r["step"] for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    said = "never closed: the 1 step(s) up to step 3 since the last log step are not written"
    assert (steps, run.stderr.count(said)) == (([2, 3], 0) if how == "closed" else ([2], 1)), run.stderr
    assert "failed to close" not in run.stderr, run.stderr  # not closed again as the interpreter ends


def test_a_monitor_left_open_in_a_function_is_collected_while_its_optimizer_lives(tmp_path):
    """README: a Monitor left open in a function that returned is collected, closing its files and
    letting go of output_dir. With update norms on, the optimizer's step hooks held it (through the
    norms collector's log_step_ahead) for as long as the optimizer lived: output_dir stayed taken,
    and its hooks copied the parameters at every later step."""
    import gc
    import weakref

    import torch

    import distmetrics as dm
    from distmetrics.collectors.param_norms import ParamSide

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = quiet_config(output_dir=str(tmp_path), log_interval=2, json_log=True, log_update_norm=True)

    def train():
        monitor = dm.Monitor(config, model=model, optimizer=optimizer)
        for step in (1, 2, 3):
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step(step)
        return weakref.ref(monitor)

    left = train()
    gc.collect()
    assert left() is None and not optimizer._optimizer_step_pre_hooks
    snapshots = []
    original = ParamSide.snapshot
    ParamSide.snapshot = lambda self, step: snapshots.append(step) or original(self, step)
    try:
        with dm.Monitor(config, model=model, optimizer=optimizer) as monitor:  # output_dir let go
            model(torch.randn(2, 8)).sum().backward()
            optimizer.step()
            monitor.step(4)
    finally:
        ParamSide.snapshot = original
    assert len(snapshots) == 1  # the new Monitor's alone (its first step, whose number it does not know yet)


# --- a Monitor's lifecycle: errors, exits, threads, the process group -----------------------------

def _rendezvous(tmp_path) -> str:
    """Where ranks that make their process group again meet: a file, not a port picked ahead (by the
    time they meet, the kernel may have handed that port to gloo's own sockets: EADDRINUSE)."""
    return f"file://{tmp_path / 'rendezvous'}"


def _destroyed_before_close(rank: int, world: int, root: str, rendezvous: str) -> tuple:
    import torch.distributed as dist

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(output_dir=root, log_interval=5, json_log=True))
    for step in range(1, 8):
        monitor.step(step, loss=float(step + rank), tokens=1)
    dist.destroy_process_group()
    outcome = _outcome(monitor.close)
    # made again for the harness, which destroys it
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=rendezvous)
    dist.barrier()
    return outcome


def test_a_process_group_destroyed_before_close_writes_nothing_as_the_jobs_and_says_so(tmp_path):
    """close() after destroy_process_group() reduced alone and wrote rank 0's loss (6.5) and tokens
    (12) as the job's (7.0 and 14) for steps 6-7, without a word."""
    import distmetrics as dm

    for kind, message, _ in run_ranks(_destroyed_before_close, 2, str(tmp_path), _rendezvous(tmp_path), timeout=120):
        assert kind == "RuntimeError" and "made for 2 ranks, but torch.distributed is not initialised" in message
    assert [r["step"] for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == [5]


def _gloo_threads() -> int:
    """gloo's threads in this process (its workers and its transport loop), as the kernel names them."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


def _closed_then_destroyed(rank: int, world: int, root: str, rendezvous: str, world_group: bool) -> tuple:
    import torch
    import torch.distributed as dist

    import distmetrics as dm

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = dm.Monitor(quiet_config(output_dir=root, log_interval=2, json_log=True, timing_log_level=0),
                         model=model, optimizer=optimizer, group=dist.group.WORLD if world_group else None)
    for step in range(1, 4):
        torch.manual_seed(step)  # the same batch on every rank: the gradients of replicas agree
        model(torch.randn(2, 4)).square().sum().backward()
        monitor.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        monitor.step(step, loss=float(step), tokens=2)
    running = _gloo_threads()
    monitor.close()  # writes step 3's record: a collective
    dist.destroy_process_group()
    left = _gloo_threads()  # the Monitor, its model and its optimizer are all still referenced here
    # made again for the harness, which destroys it
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=rendezvous)
    dist.barrier()
    return running, left


@pytest.mark.parametrize("world_group", [False, True], ids=["default", "group=WORLD"])
def test_a_closed_monitor_keeps_no_gloo_thread_alive_past_destroy_process_group(tmp_path, world_group):
    """A Monitor made with group=dist.group.WORLD held that ProcessGroup object, so
    destroy_process_group() left it and gloo's threads running into the interpreter's exit, where one
    still releasing the user's last all_reduce took the GIL and the process aborted ("terminate called
    without an active exception"): 18 of 30 two-rank torchrun runs, 0 of 30 with the default group.
    After close() and destroy_process_group() no gloo thread is left, with the Monitor, its model and
    its optimizer still alive."""
    import distmetrics as dm

    for running, left in run_ranks(_closed_then_destroyed, 2, str(tmp_path), _rendezvous(tmp_path), world_group,
                                   timeout=120):
        assert running > 0 and left == 0, (running, left)
    assert [r["step"] for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == [2, 3]


def _made_before_init(rank: int, world: int, rendezvous: str) -> tuple:
    import torch.distributed as dist

    import distmetrics as dm

    dist.destroy_process_group()
    os.environ.pop("WORLD_SIZE")  # a script spawning its ranks itself, with no launcher's variables
    monitor = dm.Monitor(quiet_config(log_interval=2))
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=rendezvous)
    dist.barrier()  # both ranks are connected before either refuses (and ends)
    monitor.step(1, loss=1.0)
    outcome = _outcome(lambda: monitor.step(2, loss=1.0))
    dist.barrier()
    return outcome


def test_a_monitor_made_for_one_rank_refuses_a_process_group_of_more(tmp_path):
    """Each rank took itself for a 1-rank job at the log step: each wrote its own files, with
    world_size 1 and tokens/s per GPU the job's."""
    for kind, message, _ in run_ranks(_made_before_init, 2, _rendezvous(tmp_path), timeout=120):
        assert kind == "RuntimeError" and "made before init_process_group, for 1 rank" in message
        assert "the process group has 2 ranks now" in message


def _user_parts():
    class Failing:
        name, after = "failing", ()

        def take_samples(self, ctx):
            return []

        def finalize(self, metrics, ctx):
            return []

        def close(self):
            raise OSError("the collector's own file")

    class Slow:  # a sink on the writer thread, slower than the close() that follows the last step
        name = "slow"

        def __init__(self):
            self.seen = []

        def log(self, metrics, step, kind):
            time.sleep(0.05)
            self.seen.append((kind, step))

        def close(self):
            pass

    return Failing(), Slow()


@pytest.mark.parametrize("how", ["close", "with"])
def test_a_collector_that_fails_to_close_leaves_the_sinks_written_and_the_folder_free(tmp_path, how, caplog):
    """A user collector raising in close() stopped close() before the sinks: the queued records were
    not written when it returned, the folder stayed locked (a new Monitor was refused as "in use by
    another Monitor", naming its own process), and inside `with` its error replaced the user's."""
    import distmetrics as dm

    failing, slow = _user_parts()
    cfg = quiet_config(output_dir=str(tmp_path), log_interval=1, json_log=True)
    monitor = dm.Monitor(cfg, collectors=[failing], sinks=[slow])
    if how == "close":
        monitor.step(1)
        with pytest.raises(OSError, match="the collector's own file"):
            monitor.close()
    else:
        with pytest.raises(KeyError, match="the loop's own error"):
            with monitor:
                monitor.step(1)
                raise KeyError("the loop's own error")
    assert ("train", 1) in slow.seen
    assert "the failing collector failed to close: OSError: the collector's own file" in caplog.text
    dm.Monitor(cfg).close()  # the folder is free


def test_an_error_inside_with_says_the_steps_it_leaves_unwritten(tmp_path, caplog):
    """Leaving a Monitor on an error (no collective: another rank may be gone) dropped the steps
    since the last log step without a word, where a Monitor never closed says them at exit."""
    import distmetrics as dm

    with pytest.raises(KeyError):
        with dm.Monitor(quiet_config(output_dir=str(tmp_path), log_interval=5, json_log=True)) as monitor:
            for step in range(1, 8):
                monitor.step(step, loss=1.0)
            raise KeyError("the loop's own error")
    assert "left its Monitor on KeyError: the 2 step(s) up to step 7 since the last log step are not written " \
           "(no collective is made after an error" in caplog.text


def test_a_monitor_called_from_a_second_thread_says_so(tmp_path):
    """An evaluation thread calling log_eval while the main thread called step took the same
    arrival-check number: a HangError naming the waiting rank itself, or gloo's "collective
    mismatch" abort (SIGABRT)."""
    import threading

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=2))
    monitor.step(1, loss=1.0)
    errors = []

    def evaluate():
        try:
            monitor.log_eval(1, loss=2.0)
        except RuntimeError as err:
            errors.append(str(err))

    thread = threading.Thread(target=evaluate, name="eval-thread")
    thread.start()
    thread.join()
    assert len(errors) == 1 and "and this one from thread 'eval-thread'" in errors[0], errors
    assert "collective calls come from thread 'MainThread'" in errors[0]
    # a value recorded from another thread (a hook autograd runs on its own thread) is taken
    recorder = threading.Thread(target=lambda: monitor.record("hooked", 3.0))
    recorder.start()
    recorder.join()
    assert monitor.step(2, loss=1.0)["hooked"] == 3.0
    monitor.close()


_EXITS = """
import os, sys, time
import torch.distributed as dist
import distmetrics as dm
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
monitor = dm.Monitor(dm.MetricsConfig(output_dir=sys.argv[1], log_interval=2, hang_timeout_s=60, console=False,
                                      tensorboard=False, json_log=False, log_progress=False, timing_log_level=-1))
monitor.step(1, loss=1.0)
if rank == 1:
    time.sleep(1.0)
    raise KeyError("the loader's own error")  # uncaught: the process ends with its Monitor open
start = time.monotonic()
try:
    monitor.step(2, loss=1.0)
except Exception as err:
    print("WAITED", round(time.monotonic() - start, 1), type(err).__name__, err, flush=True)
    time.sleep(1.0)
"""


def test_a_rank_ending_on_an_uncaught_error_is_named_at_once_not_at_hang_timeout_s(tmp_path):
    """A rank that ended on an uncaught error, its Monitor open, was waited for until hang_timeout_s
    (5 min by default: gloo alone raises at once), so a launcher's SIGTERM killed the others first,
    with no message from them."""
    from tests.dist_utils import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", _EXITS, str(tmp_path)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1]) for r in range(2)]
    out, err = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=60)
    said = "rank 1: last call its process ended on an uncaught KeyError with the Monitor open"
    assert "HangError" in out and said in out, out + err
    assert float(out.split("WAITED ")[1].split()[0]) < 30, out  # not the 60 s of hang_timeout_s


def test_a_monitor_dropped_unclosed_lets_go_of_its_files_thread_and_folder(tmp_path):
    """A Monitor left open in a notebook cell that raised kept its writer thread, its files and the
    output_dir lock until the process ended: the cell run again was refused as "in use by another
    Monitor" (its own process), and a sweep ran out of file descriptors."""
    import gc
    import threading

    import distmetrics as dm

    cfg = dm.MetricsConfig(output_dir=str(tmp_path), log_interval=1, console=False, timing_log_level=-1)
    before = threading.active_count()
    monitor = dm.Monitor(cfg)
    monitor.step(1, loss=1.0)
    del monitor
    gc.collect()
    assert threading.active_count() == before
    dm.Monitor(cfg).close()  # the folder is free
    assert [r["step"] for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == [1]


@pytest.mark.parametrize("call", ["loss", "scalar", "eval"])
def test_a_complex_value_is_refused_at_the_call(tmp_path, call):
    """A complex 1-element tensor passed the check: as the loss it raised an error naming no
    argument with the step half recorded (a retry was refused), and as any other value its
    imaginary part was dropped (train/c = 3.0 for 3+4j)."""
    import torch

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=1))
    value = torch.tensor(3 + 4j)
    with pytest.raises(TypeError, match=r"expected a real number, got a tensor of torch.complex64"):
        if call == "loss":
            monitor.step(1, loss=value)
        elif call == "scalar":
            monitor.step(1, loss=1.0, c=value)
        else:
            monitor.log_eval(1, loss=value)
    assert monitor.step(1, loss=1.0)["train/loss"] == 1.0  # nothing was recorded: the step is retried
    monitor.close()



@pytest.mark.parametrize("call", ["tokens", "loss_tokens", "record", "eval"])
def test_a_bool_tensor_is_refused_at_the_call_as_a_bool_is(tmp_path, call):
    """A 1-element bool tensor (``mask.any()`` where ``mask.sum()`` was meant) passed as a count of 1,
    though a Python bool is refused: now refused alike, naming the argument, with nothing recorded."""
    import torch

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=1))
    flag = torch.tensor(True)
    with pytest.raises(TypeError, match=rf"{call if call != 'record' else 'flag'}.*got a bool tensor"):
        if call == "tokens":
            monitor.step(1, loss=1.0, tokens=flag)
        elif call == "loss_tokens":
            monitor.step(1, loss=1.0, tokens=4, loss_tokens=flag)
        elif call == "record":
            monitor.record("flag", flag)
        else:
            monitor.log_eval(1, loss=1.0, tokens=flag)
    assert monitor.step(1, loss=1.0, tokens=4)["train/loss"] == 1.0  # nothing was recorded: the step is retried
    monitor.close()


@pytest.mark.parametrize("call", ["loss", "tokens", "scalar", "record", "weight", "eval", "losses", "experts"])
def test_a_quantized_tensor_is_refused_at_the_call_and_the_step_is_retried(call):
    """A quantized 1-element tensor passed the value check and raised torch's own error inside the step,
    its step number taken: the retry was refused ("does not increase") and the step's record lost, unsaid
    (a record() of it kept its name as a sum). Now refused at the call, naming the argument."""
    import warnings

    import torch

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of quantized tensors
        value = torch.quantize_per_tensor(torch.tensor([2.0]), 0.5, 0, torch.quint8)
    with pytest.raises(TypeError, match=r"got a quantized tensor \(torch.quint8\); pass value.dequantize\(\)"):
        if call in ("loss", "tokens"):
            monitor.step(1, **{"loss": 1.0, "tokens": 4, call: value})
        elif call == "scalar":
            monitor.step(1, loss=1.0, c=value)
        elif call in ("record", "weight"):
            monitor.record("c", value if call == "record" else 1.0, weight=value if call == "weight" else None)
        elif call == "losses":
            monitor.record_losses(value, ["code"])
        elif call == "experts":
            monitor.record_moe(tokens_per_expert=value.reshape(1, 1))
        else:
            monitor.log_eval(1, loss=value)
    monitor.record("c", 3.0, "max")  # the name was not claimed as a mean
    assert monitor.step(1, loss=1.0, tokens=4)["train/loss"] == 1.0  # nothing was recorded: the step is retried
    monitor.close()


@pytest.mark.parametrize("bad", ["quantized", "exact kind"])
def test_a_collectors_quantized_sample_or_internal_kind_fails_that_collector_on_every_rank(tmp_path, bad):
    """A user's collector handing over a quantized tensor failed in a GPU job's packs on its rank alone, after
    the MAX all-reduce (the other rank lost the record, then both hung); one using the Monitor's internal
    reduce kind 'imax' with an int past int64 raised there too. Both now fail the collector at the check
    the Monitor makes before the reduction (said as CollectorFailed, the record written without it)."""
    import warnings

    import torch

    import distmetrics as dm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of quantized tensors
        value = torch.quantize_per_tensor(torch.tensor([2.0]), 0.5, 0, torch.quint8)

    class Odd:
        name, after, writes = "odd", (), ("odd/",)

        def take_samples(self, ctx):
            return [dm.Sample("odd/q", value, "mean") if bad == "quantized" else dm.Sample("_odd/n", 5, "imax")]

        def finalize(self, metrics, ctx):
            return []

        def close(self):
            pass

    said = "got a quantized tensor (torch.quint8)" if bad == "quantized" else "reduce='imax' is the Monitor's own"
    config = quiet_config(log_interval=1, json_log=True, output_dir=str(tmp_path))
    with dm.Monitor(config, collectors=[Odd()]) as monitor:
        with pytest.raises(dm.CollectorFailed, match=re.escape(said)):
            monitor.step(1, loss=1.0)
    assert [r.get("train/loss") for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == [1.0]


def _inside_ddp_join(rank: int, world: int) -> dict:
    """Two steps inside DDP's join() with even inputs (which works), the warnings caught."""
    import logging

    import torch
    from torch.nn.parallel import DistributedDataParallel

    import distmetrics as dm

    said: list = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        with model.join():
            for step in (1, 2):
                model(torch.randn(3, 4)).sum().backward()
                monitor.clip_grad_norm_(1.0)
                monitor.step(step)
    return {"join": [m for m in said if "inside join()" in m]}


def test_ddp_join_is_said_once_before_any_clip():
    """Under DDP's join() a rank out of inputs shadows DDP's collectives, not the Monitor's: the clip's
    all-reduce met DDP's on the joined rank and gloo aborted on a size mismatch, with no word from the
    Monitor (on NCCL a hang). The first forward inside join() says so, once, on every rank."""
    for result in run_ranks(_inside_ddp_join, 2):
        assert len(result["join"]) == 1 and "the same number of steps" in result["join"][0], result

_CLOSED_AT_EXIT = """
import atexit, os, sys
import torch.distributed as dist
import distmetrics as dm
dist.init_process_group("gloo")
atexit.register(dist.destroy_process_group)  # runs last: without it gloo can abort the exit (README, "Limitations")
monitors = []
atexit.register(lambda: monitors[0].close())  # a trainer's cleanup, registered before the Monitor is made
monitors.append(dm.Monitor(dm.MetricsConfig(output_dir=sys.argv[1], log_interval=5, hang_timeout_s=20,
                                            console=False, tensorboard=False, log_progress=False,
                                            timing_log_level=-1)))
for step in range(1, 8):
    monitors[0].step(step, loss=1.0)
"""


def test_a_close_in_an_exit_hook_registered_before_the_monitor_writes_the_last_steps(tmp_path):
    """Every rank's Monitor left the arrival check at exit, before the user's own exit hook (made
    earlier, so run later) called close(): that close met its own mark, raised HangError on every
    rank, and steps 6-7 were lost."""
    import distmetrics as dm
    from tests.dist_utils import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", _CLOSED_AT_EXIT, str(tmp_path)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1]) for r in range(2)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0 and "HangError" not in err, err
    assert [r["step"] for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == [5, 7]


# --- forked children and signals ------------------------------------------------------------------

_FORKED_EVALUATION = """
import atexit, os, sys
import torch.distributed as dist
import distmetrics as dm
rank, parent = int(os.environ["RANK"]), os.getpid()
# registered first, so run last: the child ends once the exit hooks ran, without the interpreter's finalization,
# where torch's gloo process group, collected in a child that has none of its threads, never returns
atexit.register(lambda: os.getpid() != parent and os._exit(0))
dist.init_process_group("gloo")
atexit.register(lambda: os.getpid() == parent and dist.destroy_process_group())  # as a trainer should
monitor = dm.Monitor(dm.MetricsConfig(output_dir=sys.argv[1], log_interval=2, hang_timeout_s=60, console=False,
                                      tensorboard=False, log_progress=True, timing_log_level=-1))
for step in range(1, 7):
    monitor.step(step, loss=float(step))
    if rank == 0 and step == 3:
        evaluation = os.fork()  # the user's own evaluation process, forked with the Monitor open
        if evaluation == 0:
            if sys.argv[2] == "raise":
                raise RuntimeError("the evaluation's own error")
            if sys.argv[2] == "calls":  # the Monitor's calls in the child: what each raised, and the flush
                said = []
                for call in (lambda: monitor.record("x", 1.0), lambda: monitor.log_eval(3, loss=2.5),
                             lambda: monitor.step(4, loss=9.0), lambda: monitor.checkpoint_saved(4)):
                    try:
                        call()
                        said.append("returned")
                    except RuntimeError as err:
                        said.append(str(err).split(",")[0].replace(str(parent), "PARENT"))
                flushed = monitor.sinks.flush(timeout=30)
                with open(sys.argv[1] + ".child", "w") as out:
                    out.write("\\n".join(said + [f"flushed {flushed}"]))
            sys.exit(0)
        os.waitpid(evaluation, 0)
monitor.close()
print("CLOSED", flush=True)
"""


@pytest.mark.parametrize("ends", ["raise", "sysexit", "calls"])
def test_a_child_forked_by_the_user_ends_without_touching_its_parents_monitor(tmp_path, ends):
    """An evaluation process os.fork()ed on rank 0 ran the Monitor's inherited exit hook as it ended:
    on an uncaught error it left the arrival check as rank 0, through the store's inherited socket,
    and rank 1 raised HangError ("ended on an uncaught RuntimeError") with rank 0 alive; ending on
    sys.exit it warned that steps were not written. Its log_eval and step wrote an eval and a second
    step-4 train record into the parent's metrics.jsonl (summary read the child's eval as the job's),
    and a flush waited 90 s for a writer thread it does not have: each call now raises, naming the fork."""
    import distmetrics as dm
    from tests.dist_utils import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", _FORKED_EVALUATION, str(tmp_path), ends],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1]) for r in range(2)]
    try:
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0 and out.split() == ["CLOSED"], out + err
        assert "HangError" not in err and "never closed" not in err, err
    records = [(r["kind"], r["step"]) for r in dm.read_jsonl(tmp_path / "metrics.jsonl")]
    assert records == [("run", 0), ("train", 2), ("train", 4), ("train", 6), ("end", 6)], records  # none twice,
    # none more: the child wrote no end record of its own
    assert (tmp_path / "progress.txt").read_text().count("\n") == 1  # "Starting job" alone, as without a fork
    if ends == "calls":
        said = Path(str(tmp_path) + ".child").read_text().splitlines()
        assert said == ["this Monitor belongs to process PARENT"] * 4 + ["flushed True"], said


_OUTLIVED = """
import os, signal, sys, time, multiprocessing
import distmetrics as dm
config = dm.MetricsConfig(output_dir=sys.argv[1], console=False, tensorboard=False, timing_log_level=-1)
monitor = dm.Monitor(config)
monitor.step(1, loss=1.0)
uploader = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
uploader.start()
try:
    dm.Monitor(config)
except ValueError as err:
    print("SECOND", "in use by another Monitor" in str(err), flush=True)  # the trainer keeps its lock
print("UPLOADER", uploader.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_forked_child_that_outlives_a_killed_trainer_does_not_keep_its_output_dir(tmp_path):
    """A child forked after the Monitor (a multiprocessing uploader, a DataLoader worker) held a copy
    of the output_dir lock's descriptor: with the trainer killed, the next job on that folder was
    refused ("in use by another Monitor (pid <the dead trainer>)") until the child ended."""
    import distmetrics as dm

    trainer = subprocess.Popen([sys.executable, "-c", _OUTLIVED, str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, cwd=Path(__file__).resolve().parents[1])
    lines = [trainer.stdout.readline().split() for _ in range(2)]
    trainer.wait(timeout=60)
    assert lines[0] == ["SECOND", "True"] and lines[1][0] == "UPLOADER", lines
    uploader = int(lines[1][1])
    try:
        os.kill(uploader, 0)  # still alive: it sleeps 120 s
        dm.Monitor(quiet_config(output_dir=str(tmp_path), json_log=True)).close()  # the next job
    finally:
        os.kill(uploader, signal.SIGKILL)
    assert trainer.returncode == -signal.SIGKILL


class _Interrupted:
    """A collector whose finalize, at the log step of ``step``, receives a real signal (SIGUSR1)."""

    name, after = "interrupted", ()

    def __init__(self, step: int) -> None:
        self.step = step

    def take_samples(self, ctx):
        return []

    def finalize(self, metrics, ctx):
        if ctx.step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)
            sum(range(10))  # the handler runs between these bytecodes
        return []

    def close(self):
        pass


@pytest.mark.parametrize("where", ["finalize", "encode"])
@pytest.mark.parametrize("handler", ["exit", "close"])
def test_a_signal_inside_a_log_step_after_its_samples_says_the_record_is_not_written(tmp_path, monkeypatch, caplog,
                                                                                     where, handler):
    """A signal whose handler raises (sys.exit, as the README suggests) or closes the Monitor, landing
    after the log step's reduction (in a collector's finalize, in the JSONL encoding), lost the
    record of that step and its steps without a word: they had been taken out of the interval, so
    neither close() nor the exit hook saw them, and after a close() the record went to a writer
    thread that had ended."""
    import distmetrics as dm
    from distmetrics.sinks import jsonl

    if where == "encode":
        real = jsonl._pieces

        def pieces(kind, step, metrics, finite):
            if kind == "train" and step == 4:
                os.kill(os.getpid(), signal.SIGUSR1)
                sum(range(10))
            return real(kind, step, metrics, finite)

        monkeypatch.setattr(jsonl, "_pieces", pieces)
    _, queued = _user_parts()
    monitor = dm.Monitor(quiet_config(output_dir=str(tmp_path), log_interval=2, json_log=True), sinks=[queued],
                         collectors=[_Interrupted(4 if where == "finalize" else -1)])
    closed = []

    def on_signal(signum, frame):
        if handler == "exit":
            sys.exit(128 + signum)
        monitor.close()
        closed.append(list(queued.seen))

    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        for step in (1, 2, 3):
            monitor.step(step, loss=1.0)
        if handler == "exit":
            with pytest.raises(SystemExit):
                monitor.step(4, loss=1.0)
        else:
            monitor.step(4, loss=1.0)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    monitor.close()
    why = "SystemExit" if handler == "exit" else "monitor.close() was called during it"
    said = f"the log step at step 4 did not complete ({why}): the 2 step(s) up to it since the last log step are " \
           "not written"
    assert caplog.text.count(said) == 1 and "cannot write" not in caplog.text, caplog.text  # nothing after close
    assert [r["step"] for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == [2]
    assert ("train", 4) not in queued.seen and closed in ([], [queued.seen]), (closed, queued.seen)


def _warnings_said() -> list:
    """The messages the ``distmetrics`` logger says in this process from now on."""
    import logging

    said: list = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    return said


def _step_ms(step: int) -> float:
    return 10.0 + step  # each step its own length: a step counted in the wrong interval shows


def _step_tokens(rank: int, step: int) -> int:
    return 100 + 10 * rank + step


def _step_loss(rank: int, step: int) -> float:
    return step + rank / 2


def _closed_by_a_signal_inside_step(rank: int, world: int, out: str) -> dict:
    """For each step ``at``: steps 1 to ``at`` of 10 ms + step each (a fake clock), where a real SIGTERM,
    whose handler calls monitor.close(), is sent (os.kill) inside ``monitor.step(at)`` just after the
    train collector recorded the step (its ``record_step`` patched on the instance), before the Monitor
    counted it."""
    import distmetrics as dm
    from tests.dist_utils import FakeClock

    said = _warnings_said()
    result: dict = {}
    for at in (14, 11, 20):
        with FakeClock() as clock:
            monitor = dm.Monitor(quiet_config(output_dir=f"{out}/{at}", log_interval=10, json_log=True,
                                              log_throughput=True, hang_timeout_s=60.0))
            train = monitor._by_name["train"]
            record_step, step = train.record_step, 0

            def recorded_then_signalled(*args, **kwargs):
                record_step(*args, **kwargs)
                if step == at:
                    os.kill(os.getpid(), signal.SIGTERM)
                    sum(range(10))  # the handler runs here at the latest

            train.record_step = recorded_then_signalled
            previous = signal.signal(signal.SIGTERM, lambda signum, frame: monitor.close())
            returned, error = None, None
            try:
                for step in range(1, at + 1):
                    clock.advance(_step_ms(step))
                    returned = monitor.step(step, loss=_step_loss(rank, step), tokens=_step_tokens(rank, step))
            except Exception as err:  # noqa: BLE001 - the test reads it
                error = f"{type(err).__name__}: {err}"
            finally:
                signal.signal(signal.SIGTERM, previous)
            refused = _outcome(lambda: monitor.step(at + 1))[0]
        records = [r for r in dm.read_jsonl(f"{out}/{at}/metrics.jsonl") if r["kind"] == "train"] if rank == 0 else []
        result[at] = {"returned": returned, "error": error, "refused": refused, "records": records}
    result["said"] = said
    return result


def test_a_signal_whose_handler_closes_inside_a_step_counts_that_step_whole(tmp_path):
    """A signal whose handler calls monitor.close() (a real SIGTERM sent with os.kill, on both gloo ranks)
    landing inside monitor.step after the train collector recorded the step (its record_step patched on
    the instance to send it) and before the Monitor counted it: at step 14 the close record put 4 steps'
    tokens over 3 steps' time (step time 25% low, tokens/s 33% high); at step 11, just after a log step,
    nothing was written and the warning blamed the user ("'train/loss', '_train/tokens' recorded after
    the last monitor.step (step 11, logged) are not written"), naming an internal lane; at step 20, a log
    step, the step went on into its log step's collectives after the close. The close record counts the
    step whole, as on a rank whose signal came after the step, and the step returns."""
    out = run_ranks(_closed_by_a_signal_inside_step, 2, str(tmp_path), timeout=180)
    for at in (14, 11, 20):
        steps = range(11, at + 1)  # the interval after the log step at 10, the signalled step in it
        tokens = [_step_tokens(r, s) for r in range(2) for s in steps]
        losses = [_step_loss(r, s) for r in range(2) for s in steps]
        seconds = sum(_step_ms(s) for s in steps) / 1000
        records = out[0][at]["records"]
        assert [r["step"] for r in records] == [10, at], records  # one record of the step, by close()
        last = records[-1]
        assert last["train/step_time_ms"] == pytest.approx(seconds * 1000 / len(steps), rel=1e-6), (at, last)
        assert last["train/tokens_per_sec"] == pytest.approx(sum(tokens) / seconds, rel=1e-6), (at, last)
        assert last["train/consumed_tokens"] == sum(_step_tokens(r, s) for r in range(2) for s in range(1, at + 1))
        weighted = sum(loss * n for loss, n in zip(losses, tokens)) / sum(tokens)
        assert last["train/loss"] == pytest.approx(weighted, rel=1e-6), (at, last)
    for rank, result in enumerate(out):
        assert not any("recorded after" in m or "'_" in m for m in result["said"]), (rank, result["said"])
        for at in (14, 11, 20):
            case = result[at]
            assert case["error"] is None and case["returned"] is None and case["refused"] == "RuntimeError", (rank, at)


def _signal_between_the_jsonl_and_the_queue(rank: int, world: int, out: str, handler: str) -> dict:
    """Steps 1-15, log_interval 5, JSONL and TensorBoard: on the writer rank a real SIGTERM is sent
    (os.kill) in the writer queue's put of the train record of step 15 (``put`` patched on the
    instance), after the JSONL line of step 15 is written; its handler exits (``sys.exit``) or closes."""
    import distmetrics as dm

    said = _warnings_said()
    monitor = dm.Monitor(quiet_config(output_dir=out, log_interval=5, json_log=True, tensorboard=True,
                                      hang_timeout_s=60.0))
    if monitor.is_writer:
        put = monitor.sinks.writer.put

        def signalled_then_put(metrics, step, kind, keep=False):
            if (kind, step) == ("train", 15):
                os.kill(os.getpid(), signal.SIGTERM)
                sum(range(10))  # the handler runs here at the latest
            return put(metrics, step, kind, keep)

        monitor.sinks.writer.put = signalled_then_put

    def on_signal(signum, frame):
        if handler == "exit":
            sys.exit(128 + signum)
        monitor.close()

    previous = signal.signal(signal.SIGTERM, on_signal)
    exited = False
    try:
        for step in range(1, 16):
            monitor.step(step, loss=_step_loss(rank, step), tokens=_step_tokens(rank, step))
    except SystemExit:
        exited = True
    finally:
        signal.signal(signal.SIGTERM, previous)
    monitor.close()
    if rank != 0:
        return {"said": said, "exited": exited}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(f"{out}/tensorboard", size_guidance={"scalars": 0})
    board.Reload()
    return {"said": said, "exited": exited, "tensorboard": [e.step for e in board.Scalars("train/loss")],
            "jsonl": [r["step"] for r in dm.read_jsonl(f"{out}/metrics.jsonl") if r["kind"] == "train"]}


@pytest.mark.parametrize("handler", ["exit", "close"])
def test_a_log_step_interrupted_between_the_jsonl_and_the_queue_names_the_sinks_with_and_without_it(tmp_path,
                                                                                                      handler):
    """A signal whose handler exits or closes, landing in a log step after its JSONL line was written
    and before its record was queued for TensorBoard (a real SIGTERM sent with os.kill from the writer
    queue's put, patched on the instance, on the writer of two gloo ranks), was said as "the 5 step(s)
    up to it since the last log step are not written" while metrics.jsonl had step 15. The warning
    names the sinks that have the record and those that do not, as the files read back show."""
    out = run_ranks(_signal_between_the_jsonl_and_the_queue, 2, str(tmp_path), handler, timeout=180)
    assert [o["exited"] for o in out] == [handler == "exit", False], out
    assert out[0]["jsonl"] == [5, 10, 15] and out[0]["tensorboard"] == [5, 10], out[0]
    why = "SystemExit" if handler == "exit" else "monitor.close() was called during it"
    said = [m for m in out[0]["said"] if "did not complete" in m]
    assert said == [f"distmetrics: the log step at step 15 did not complete ({why}): its record of the 5 step(s) "
                    "up to it since the last log step is written to jsonl, not to tensorboard"], out[0]["said"]
    assert not any("did not complete" in m for m in out[1]["said"]), out[1]["said"]


_SIGTERM_IN_THE_ARRIVAL_CHECK = """
import os, signal, sys, time
import torch.distributed as dist
import distmetrics as dm
import distmetrics.guard
distmetrics.guard.WAIT_SLICE_S = 1.0  # the first store wait: a handler runs at its end (5 s by default)
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")

def on_sigterm(signum, frame):  # the README's handler, or a close() and an exit without the exit hooks
    print("HANDLED", time.time(), flush=True)
    if sys.argv[3] == "close":
        monitor.close()
        os._exit(128 + signum)
    if sys.argv[3] == "raise":  # a handler of the user's raising its own error
        raise RuntimeError("preempted")
    sys.exit(128 + signum)

signal.signal(signal.SIGTERM, on_sigterm)
monitor = dm.Monitor(dm.MetricsConfig(output_dir=sys.argv[1], writer_rank="last", log_interval=2, hang_timeout_s=20,
                                      console=False, tensorboard=False, log_progress=False, timing_log_level=-1))
for step in (1, 2, 3):
    monitor.step(step, loss=1.0)
if rank == 0:
    sys.stdin.readline()  # the test lets it come once rank 1 has ended
waiting = distmetrics.guard.CollectiveGuard._wait


def said_waiting(guard, done):  # inside the call's wait, where the signal is to land (not before the call)
    print("WAITING", flush=True)
    return waiting(guard, done)


distmetrics.guard.CollectiveGuard._wait = said_waiting
start = time.monotonic()
try:
    monitor.step(4, loss=1.0) if sys.argv[2] == "log step" else monitor.checkpoint_saved(3)
except Exception as err:
    print("RAISED", round(time.monotonic() - start, 1), type(err).__name__, err, flush=True)
"""


@pytest.mark.parametrize("call,handler,said,left", [
    ("log step", "exit", "the log step at step 4 did not complete (SystemExit): the 2 step(s) up to it since the "
     "last log step are not written", "left its Monitor on SystemExit, after monitor.step(step=4)"),
    ("checkpoint", "exit", "the process ends with a Monitor open, never closed: the 1 step(s) up to step 3 since the "
     "last log step are not written", "left its Monitor on SystemExit, after monitor.checkpoint_saved(step=3)"),
    ("log step", "close", "the log step at step 4 did not complete (monitor.close() was called during it): the 2 "
     "step(s) up to it since the last log step are not written", "closed its Monitor, after monitor.step(step=4)"),
    ("checkpoint", "close", "monitor.close() was called while this rank waited at an arrival check: the 1 step(s) up "
     "to step 3 since the last log step are not written", "closed its Monitor, after monitor.checkpoint_saved(step=3)"),
    ("log step", "raise", "the log step at step 4 did not complete (RuntimeError): the 2 step(s) up to it since the "
     "last log step are not written", "left its Monitor on RuntimeError, after monitor.step(step=4)")],
    ids=["log-step-exit", "checkpoint-exit", "log-step-close", "checkpoint-close", "log-step-raise"])
def test_a_sigterm_ends_a_rank_waiting_at_the_arrival_check_at_once_and_its_peers_do_not_wait(tmp_path, call, handler,
                                                                                               said, left):
    """A real SIGTERM (os.kill, as scancel sends) to the writer rank of two gloo processes, waiting at
    the arrival check of the log step at 4 or of checkpoint_saved(3) for rank 0, whose handler is the
    README's sys.exit(128 + signum): the rank sat in one store wait of hang_timeout_s (20 s; 300 by
    default), its handler unrun, so a launcher's SIGKILL 30 s later came first, with nothing said or
    flushed; and rank 0, coming later, waited hang_timeout_s more (also after a handler's close() and
    os._exit: the close marked rank 1's next guarded call, not the one it was in). The handler runs
    within about a second, the rank ends through its exit hooks (or its close) saying which steps are
    not written, and rank 0 raises at once, naming rank 1 as having left."""
    from tests.dist_utils import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", _SIGTERM_IN_THE_ARRIVAL_CHECK, str(tmp_path), call, handler],
                              env={**env, "RANK": str(r)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
             for r in range(2)]
    try:
        assert procs[1].stdout.readline().strip() == "WAITING"  # inside its wait for rank 0 (hang_timeout_s 20)
        time.sleep(0.2)
        sent = time.time()
        os.kill(procs[1].pid, signal.SIGTERM)
        out, err = procs[1].communicate(timeout=60)
        procs[0].stdin.write("go\n")
        procs[0].stdin.flush()
        out0, err0 = procs[0].communicate(timeout=60)
    finally:
        for proc in procs:
            proc.kill()
    handled = float(out.split("HANDLED ")[1].split()[0])
    assert handled - sent < 10, (handled - sent, err[-3000:])  # not at hang_timeout_s (20 s); ~1 s when idle
    assert procs[1].returncode == (0 if handler == "raise" else 143), err[-3000:]  # the script catches the error
    # the handler's own error is the one raised (not a HangError from a store failure it was taken for)
    assert err.count(f"distmetrics: {said}") == 1 and ("RuntimeError preempted" in out) == (handler == "raise"), err
    import distmetrics as dm

    assert [r["step"] for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == [2]
    waited = re.search(r"RAISED ([0-9.]+) HangError (.*)", out0)
    assert waited, out0 + err0[-3000:]
    assert float(waited.group(1)) < 10 and _named(waited.group(2), "left") == {1: left}, out0  # not hang_timeout_s


def _a_monitor_call_from_a_handler_in_the_arrival_check(rank: int, world: int) -> tuple:
    """Rank 1 waits at the log step's arrival check for rank 0 (2 s late); a SIGALRM handler there calls
    monitor.log_eval. The first store wait is made 0.2 s long so the handler runs within the test's time."""
    import distmetrics as dm
    import distmetrics.guard as guard

    guard.WAIT_SLICE_S = 0.2
    monitor = dm.Monitor(quiet_config(log_interval=1, hang_timeout_s=20))
    monitor.step(1, loss=1.0)
    if rank == 1:
        signal.signal(signal.SIGALRM, lambda *_: monitor.log_eval(2, loss=1.0))
        signal.setitimer(signal.ITIMER_REAL, 0.5)
    else:
        time.sleep(2.0)
    outcome = _outcome(lambda: monitor.step(2, loss=1.0))
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    monitor._shutdown(quiet=True)
    return outcome


def test_a_monitor_call_a_signal_handler_makes_inside_an_arrival_check_raises_and_marks_that_call():
    """A handler's monitor call (log_eval) landing in this rank's wait at another guarded call would enter a
    second arrival check inside the first, its own collectives after it, while the peers wait at the first:
    it raises there, and the call the rank waits at is marked left, so the peer raises at once naming it."""
    (kind0, said0, waited0), (kind1, said1, _) = run_ranks(_a_monitor_call_from_a_handler_in_the_arrival_check, 2,
                                                            timeout=120)
    assert kind1 == "HangError" and "monitor.log_eval(step=2) was called while this rank waited at the arrival " \
        "check of monitor.step(step=2)" in said1, said1
    assert kind0 == "HangError" and waited0 < 10, (said0, waited0)  # at once on arriving, not at hang_timeout_s
    assert list(_named(said0, "left")) == [1], said0  # as one that left (then closed), not as one not arrived


def _megatron_over_the_world_monitor_on_a_group(rank: int, world: int) -> tuple:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import distmetrics as dm

    ps.initialize_model_parallel(tensor_model_parallel_size=2)  # TP groups {0, 1} and {2, 3}
    jobs = [dist.new_group([0, 1, 2]), dist.new_group([3])]  # every rank makes every group
    mine = jobs[0] if rank < 3 else jobs[1]
    return _outcome(lambda: dm.Monitor(quiet_config(hang_timeout_s=TIMEOUT_S), group=mine))


def test_a_monitor_on_a_group_that_does_not_hold_megatrons_groups_is_refused_on_every_rank():
    """Megatron initialised over the world, a job's Monitor on ranks 0-2: the start-up gather ran
    over Megatron's groups, which hold another job's rank 3 (a hang until gloo's timeout), and
    stages, tokens and losses were read from the world's layout. Ranks 0 and 1, whose own groups lie
    inside, raise with rank 2 (the start-up gather says it), rather than wait for it there."""
    out = run_ranks(_megatron_over_the_world_monitor_on_a_group, 4, timeout=120)
    for rank, (kind, message, _) in enumerate(out):
        assert kind == "ValueError", (rank, kind, message)
        if rank < 3:
            assert "tensor-parallel group of rank 2 holds ranks [3]" in message, message
        else:
            assert "tensor-parallel group of rank 3 holds ranks [2]" in message, message


def _record_while_the_other_rank_is_late_to_eval(rank: int, world: int) -> dict:
    import threading

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=100, hang_timeout_s=30.0))
    monitor.step(1)
    waited = []

    def recorder():  # a thread of the user's recording while its main thread is in log_eval's collective
        time.sleep(0.5)
        start = time.monotonic()
        monitor.record("u/x", 1.0)
        waited.append(time.monotonic() - start)

    thread = threading.Thread(target=recorder)
    if rank == 0:
        thread.start()
    else:
        time.sleep(4.0)  # rank 0 waits for rank 1 at log_eval meanwhile
    monitor.log_eval(1, loss=2.0)
    if rank == 0:
        thread.join()
    monitor.close()
    return {"waited": waited}


def test_a_record_made_while_its_rank_waits_in_log_eval_does_not_wait_for_the_other_ranks():
    """log_eval held the record lock through its arrival check and collective: a thread recording on
    a rank that waited there waited for every other rank (and a thread that another rank waited on
    deadlocked both, named a hang). The lock is held while the eval categories are taken only."""
    out = run_ranks(_record_while_the_other_rank_is_late_to_eval, 2, timeout=120)
    assert out[0]["waited"] and out[0]["waited"][0] < 2.0, out  # rank 1 came 3.5 s later: not waited for


def _recorded_after_the_last_step(rank: int, world: int, out: str) -> dict:
    """Steps 1 to 3 (log_interval 2: step 3 unlogged, close() writes it) or 1 to 2 (logged), each with a
    ``probe`` of step + rank and a ``record_losses`` sample of 1 + rank; after the last step, what belongs
    to no written step: ``probe`` again, a name of this rank's own, a training and an evaluation sample."""
    import torch

    import distmetrics as dm

    said = _warnings_said()
    result: dict = {}
    for case, last in (("unlogged", 3), ("logged", 2)):
        monitor = dm.Monitor(quiet_config(output_dir=f"{out}/{case}", log_interval=2, json_log=True))
        for step in range(1, last + 1):
            monitor.record("probe", float(step + rank))
            monitor.record_losses(torch.tensor([1.0 + rank]), ["a"])
            monitor.step(step, loss=1.0, tokens=10)
        monitor.record("probe", 100.0)
        monitor.record(f"late/rank{rank}", 5.0)
        monitor.record_losses(torch.tensor([100.0]), ["late"])
        monitor.record_losses(torch.tensor([7.0]), ["held"], split="eval")
        before = len(said)
        monitor.close()
        records = [r for r in dm.read_jsonl(f"{out}/{case}/metrics.jsonl") if r["kind"] != "run"] if rank == 0 else []
        result[case] = {"said": said[before:], "records": records}
    return result


def test_what_is_recorded_after_the_last_step_is_left_out_of_the_close_record_and_said(tmp_path):
    """Recorded after the last monitor.step, where close() writes the steps since the last log step:
    record_losses' samples were dropped without a word, a record() was written into the last step's
    record as that step's (probe read the mean of 3.5 and 100), and eval samples with no log_eval after
    them were dropped without a word (after a logged last step too). close() leaves them out of its
    record and says them, naming them, on the rank that recorded them, whether or not the last step
    was logged. Truth: the steps' own values, reduced by hand."""
    out = run_ranks(_recorded_after_the_last_step, 2, str(tmp_path), timeout=120)
    unlogged, logged = out[0]["unlogged"]["records"], out[0]["logged"]["records"]
    assert [(r["kind"], r["step"]) for r in unlogged] == [("train", 2), ("train", 3), ("end", 3)], unlogged
    assert [(r["kind"], r["step"]) for r in logged] == [("train", 2), ("end", 2)], logged
    last = unlogged[-2]
    assert last["probe"] == (3 + 0 + 3 + 1) / 2 and last["train/loss/a"] == (1.0 + 2.0) / 2, last
    assert not any(name.startswith(("late", "train/loss/late")) for name in last), last
    for rank, result in enumerate(out):
        for case, step in (("unlogged", 3), ("logged", 2)):
            said = [m for m in result[case]["said"] if "close() on rank" in m]
            assert len(said) == 2, (rank, case, result[case]["said"])
            train, held = said
            assert f"close() on rank {rank}: 'probe', 'late/rank{rank}', \"record_losses' samples\" recorded after " \
                   f"the last monitor.step (step {step}" in train, (rank, case, train)
            assert f"rank{1 - rank}" not in train
            assert held.startswith(f"distmetrics: close() on rank {rank}: record_losses(split='eval') samples"), held


def test_a_close_landing_inside_the_steps_own_record_keeps_what_it_recorded(caplog):
    """A signal handler's close() landing inside the train collector's record of a step, after its loss was
    recorded and before the step's values were marked as its own: the close record counted the step but
    took its loss back as recorded after the last step (6.0 for 6.5), and said so falsely. The signal is
    stood in for by a narrow patch of the collector's ``stats.record`` that calls close() at that point."""
    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=10))
    train = monitor._by_name["train"]
    record = train.stats.record

    def interrupted(name, value, *args, **kwargs):
        record(name, value, *args, **kwargs)
        if name == "train/loss" and value == 9.0:
            monitor.close()

    train.stats.record = interrupted
    for step, loss in ((1, 4.0), (2, 5.0), (3, 9.0)):
        monitor.step(step, loss=loss)
    assert monitor.last_metrics["train/loss"] == 6.0  # (4 + 5 + 9) / 3: step 3's loss is in the close record
    assert not [r for r in caplog.records if "recorded after the last monitor.step" in r.getMessage()]


class _After(_ClassCollector):
    def __init__(self, name: str, after: tuple) -> None:
        self.name, self.after, self.writes = name, after, ()


def _afters_in_a_circle_on_one_rank(rank: int, world: int) -> str:
    import distmetrics as dm

    mine = [_After("a", ("b",)), _After("b", ("a",))] if rank == 1 else [_After("a", ()), _After("b", ("a",))]
    try:
        dm.Monitor(quiet_config(hang_timeout_s=600.0), collectors=mine).close()
        return "made"
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"


def test_collectors_after_each_other_in_a_circle_on_one_rank_are_said_on_every_rank():
    """The circle was found after the start-up gather, on that rank alone: it raised, and the other
    rank waited for it in its first collective until hang_timeout_s (10 minutes here)."""
    said = run_ranks(_afters_in_a_circle_on_one_rank, 2, timeout=120)
    assert "collectors depend on each other in a circle: a -> b -> a" in said[1], said
    assert said[0] != "made" and "rank 1" in said[0] and "in a circle" in said[0], said
