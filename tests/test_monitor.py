"""The Monitor on 3 real gloo ranks: loss weighting, writer rank, sinks read back, no
collective or host sync on non-log steps, and a failing sink that does not stop the run."""

import json
import math
from functools import partial

import pytest

from tests.dist_utils import CollectiveCounter, FakeClock, quiet_config, run_ranks

WORLD = 3
INTERVAL = 4
STEPS = 8


def loss_of(rank: int, step: int):
    """Rank 2 is a pipeline stage without the loss."""
    return None if rank == 2 else 1.0 + 0.1 * rank + 0.01 * step * step


def tokens_of(rank: int, step: int) -> int:
    return 10 * (rank + 1) + step


class BrokenSink:
    name = "broken"
    fix = "nothing: this sink always fails"

    def log(self, metrics, step, kind):
        raise OSError("disk full")

    def close(self):
        pass


def _train(rank: int, world: int, root: str) -> dict:
    import torch

    import distmetrics as dm

    out: dict = {}
    cfg = dm.MetricsConfig(output_dir=f"{root}/first/rank{rank}", log_interval=INTERVAL, timing_log_level=-1,
                           wandb_project="distmetrics-test", wandb_mode="offline",
                           wandb_save_dir=f"{root}/first/rank{rank}", wandb_exp_name="core-test", total_steps=STEPS)
    monitor = dm.Monitor(cfg, sinks=(BrokenSink(),))
    logs = {}
    counts = []
    for step in range(1, STEPS + 1):
        loss = loss_of(rank, step)
        if rank == 1 and step == 6:
            loss = math.nan  # a NaN must reach the JSONL file and be read back as NaN
        with CollectiveCounter() as counter:
            monitor.record("probe/max", float(10 * rank + step), reduce="max")
            m = monitor.step(step, loss=None if loss is None else torch.tensor(loss),
                             tokens=torch.tensor(tokens_of(rank, step)), lr=0.001 * step,
                             grad_scale=float(rank))
        counts.append((step, counter.collectives, counter.items))
        if m is not None:
            logs[step] = {k: v for k, v in m.items() if isinstance(v, (int, float))}
    out["logs"] = logs
    out["counts"] = counts
    eval_metrics = monitor.log_eval(STEPS, loss=torch.tensor(2.0 + rank), tokens=100 * (rank + 1))
    out["eval"] = eval_metrics
    monitor.close()  # the broken sink runs on the writer thread: its failure is certain once closed
    out["failed_sinks"] = dict(monitor.sinks.failed)

    # writer_rank: last
    with dm.Monitor(dm.MetricsConfig(output_dir=f"{root}/last/rank{rank}", writer_rank="last",
                                     log_interval=2, tensorboard=False)) as last:
        for step in (1, 2):
            last.step(step, loss=1.0)
        out["last_is_writer"] = last.is_writer

    # tensor parallelism: the three ranks are one TP group, so each step is one batch of 100 tokens
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with dm.Monitor(quiet_config(log_interval=2, log_throughput=True), device_mesh=mesh) as tp:
        out["tp_train"] = [tp.step(step, loss=1.0, tokens=100) for step in (1, 2)][-1]["train/consumed_tokens"]
        out["tp_eval"] = tp.log_eval(2, loss=1.0, tokens=100, time_ms=500.0)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("monitor")
    results = run_ranks(_train, WORLD, str(root))
    return root, results


def expected_loss(steps) -> float:
    num = den = 0.0
    for step in steps:
        for rank in range(WORLD):
            loss = loss_of(rank, step)
            if loss is None:
                continue
            num += loss * tokens_of(rank, step)
            den += tokens_of(rank, step)
    return num / den


def test_train_loss_is_the_token_weighted_mean_over_ranks_and_steps(run):
    _, results = run
    logs = results[0]["logs"]
    assert set(logs) == {4, 8}
    assert logs[4]["train/loss"] == pytest.approx(expected_loss(range(1, 5)), rel=1e-7)  # inputs are float32 tensors
    assert all(r["logs"][4]["train/loss"] == logs[4]["train/loss"] for r in results)


def test_nan_loss_on_one_rank_makes_the_interval_nan(run):
    _, results = run
    assert math.isnan(results[0]["logs"][8]["train/loss"])


EMPTY = {  # (rank, step) -> (loss, tokens): rank 1's all-masked micro-batches have 0 tokens and a NaN or Inf loss
    (1, 1): (math.nan, 0), (1, 3): (math.nan, 0), (1, 4): (math.inf, 0)}


def _empty_batches(rank: int, world: int, tensors: str) -> dict:
    import torch

    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=4)) as monitor:
        for step in range(1, 5):
            loss, tokens = EMPTY.get((rank, step), (2.0 + rank + 0.1 * step, 10 * (rank + 1) + step))
            if "loss" in tensors:
                loss = torch.tensor(loss)
            if "tokens" in tensors:
                tokens = torch.tensor(tokens)
            monitor.record_losses(torch.tensor([1.0 + rank, math.nan]), ["a", "a"], weights=torch.tensor([2.0, 0.0]))
            monitor.record("probe", math.nan if rank else 5.0, "mean", weight=0.0 if rank else 1.0)
            metrics = monitor.step(step, loss=loss, tokens=tokens)
    return {k: v for k, v in metrics.items() if k in ("train/loss", "train/loss/a", "probe", "health/nonfinite_loss")}


@pytest.mark.parametrize("tensors", ["", "loss tokens", "loss", "tokens"],
                         ids=["numbers", "tensors", "loss a tensor", "tokens a tensor"])
def test_a_rank_step_with_no_tokens_counts_for_nothing_even_with_a_nan_loss(tensors):
    """An all-masked micro-batch has 0 tokens and a loss that is a mean over nothing (NaN, or Inf):
    weight 0 means no value, so it is neither averaged (NaN · 0 would make every rank's mean NaN)
    nor counted as a non-finite loss; the same for record_losses' samples and monitor.record;
    loss and tokens as numbers, tensors, or one of each. Ground truth: the token-weighted mean over the (rank, step)s with tokens."""
    num = den = 0.0
    for rank in range(2):
        for step in range(1, 5):
            if (rank, step) not in EMPTY:
                tokens = 10 * (rank + 1) + step
                num, den = num + (2.0 + rank + 0.1 * step) * tokens, den + tokens
    for metrics in run_ranks(_empty_batches, 2, tensors):
        assert metrics["train/loss"] == pytest.approx(num / den, rel=1e-7)
        assert metrics["health/nonfinite_loss"] == 0
        assert metrics["train/loss/a"] == pytest.approx(1.5) and metrics["probe"] == 5.0


def _eval_of_uneven_ranks(rank: int, world: int) -> dict:
    import logging

    import distmetrics as dm

    out = {}
    with dm.Monitor(quiet_config()) as monitor:  # time_ms= and its written name alike
        out["uneven"] = [monitor.log_eval(5, loss=2.0, tokens=100, time_ms=1000.0 * (2 * rank + 1)),
                         monitor.log_eval(6, loss=2.0, tokens=100, **{"eval/time_ms": 1000.0 * (2 * rank + 1)})]
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    # rank 1 gives no tokens (weight 1 per step) where rank 0 gives 100: the mean was (1·200 + 3·2) / 202;
    # then rank 0 alone gives tokens at one step and none at the next
    with dm.Monitor(quiet_config(log_interval=2)) as monitor:
        for step in (1, 2):
            metrics = monitor.step(step, loss=1.0 + 2 * rank, tokens=None if rank else 100)
        out["train across ranks"] = metrics
        for step in (3, 4):
            metrics = monitor.step(step, loss=1.0, tokens=100 if rank or step == 3 else None)
        out["train across steps"] = metrics
        for step in (5, 6):
            metrics = monitor.step(step, loss=1.0 + 2 * rank)
        out["train by steps"] = metrics
        out["eval across ranks"] = monitor.log_eval(6, loss=1.0 + 2 * rank, tokens=None if rank else 100)
    out["said"] = said
    return out


@pytest.fixture(scope="module")
def two_ranks_eval():
    return run_ranks(_eval_of_uneven_ranks, 2)


def test_losses_weighted_by_tokens_on_some_ranks_or_steps_and_by_steps_on_others_are_left_out(two_ranks_eval):
    """tokens=None on one rank and tokens on another mixed step counts into token weights: train/loss
    1.0198 (neither the mean per token nor per step), and the same for eval/loss, without a word."""
    for rank, out in enumerate(two_ranks_eval):
        assert "train/loss" not in out["train across ranks"] and "train/loss" not in out["train across steps"]
        assert "eval/loss" not in out["eval across ranks"] and "eval/ppl" not in out["eval across ranks"]
        assert out["train by steps"]["train/loss"] == 2.0  # tokens=None everywhere: a mean per step
        said = [m for m in out["said"] if "is left out" in m]
        if rank == 0:
            assert len(said) == 2, said  # one warning for train records, one for eval records
            assert "rank 1 passed its losses with tokens=None and rank 0 with tokens" in said[0], said
            assert "eval/loss" in said[1] and "rank 1 passed its losses with tokens=None" in said[1], said
        else:
            assert said == []


def test_eval_tokens_per_second_is_over_the_slowest_ranks_time(two_ranks_eval):
    """An evaluation lasts as long as its slowest rank (the others wait for it at its end), as a
    training step does: 200 tokens over 3 s, not over the ranks' mean of 2 s."""
    for metrics in (m for out in two_ranks_eval for m in out["uneven"]):
        assert metrics["eval/time_ms"] == 3000.0 and metrics["eval/time_ms/max_rank"] == 1
        assert metrics["eval/tokens_per_sec"] == pytest.approx(200 / 3.0)


def _losses_over_no_tokens(rank: int, world: int) -> dict:
    import logging

    import distmetrics as dm

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    out = {}
    with FakeClock() as clock, dm.Monitor(quiet_config(log_interval=2, log_throughput=True)) as monitor:
        for step in (1, 2, 3, 4, 5, 6):  # steps 3 and 4: every rank's batches were all masked
            clock.advance(100)
            out[step] = monitor.step(step, loss=1.0 + rank, tokens=0 if step in (3, 4) else 10)
        out["eval"] = monitor.log_eval(6, loss=2.0, tokens=0, time_ms=50.0)
        out["eval again"] = monitor.log_eval(7, loss=2.0, tokens=0, time_ms=50.0)
    logging.getLogger("distmetrics").removeHandler(handler)
    return {"records": {key: out[key] for key in (2, 4, 6, "eval", "eval again")},
            "said": [line for line in said if "0 tokens" in line]}


def test_a_loss_over_no_tokens_is_left_out_with_one_warning_and_tokens_per_sec_is_0():
    """Every rank passed tokens=0 with its loss for a whole interval (or an evaluation): the token-weighted
    mean over no tokens has no value, and train/loss, eval/loss, eval/ppl and eval/gap vanished without a
    word, while train/tokens_per_sec read 0.0 and eval/tokens_per_sec was left out. Said once for train and
    once for eval records, by the first rank; 0 tokens over a measured time is 0.0 tokens/s in both."""
    out = run_ranks(_losses_over_no_tokens, 2, timeout=120)
    records = out[0]["records"]
    assert records == out[1]["records"]
    assert records[2]["train/loss"] == pytest.approx(1.5) and records[6]["train/loss"] == pytest.approx(1.5)
    assert "train/loss" not in records[4] and records[4]["train/tokens_per_sec"] == 0.0
    for key in ("eval", "eval again"):
        assert not [name for name in ("eval/loss", "eval/ppl", "eval/gap") if name in records[key]], records[key]
        assert records[key]["eval/tokens_per_sec"] == 0.0 and records[key]["eval/time_ms"] == 50.0
    assert out[1]["said"] == []
    assert out[0]["said"] == [
        "distmetrics: train/loss is left out of the record of step 4, and of every record where this recurs: every "
        "loss in it was given with 0 tokens (loss_tokens where given) on every rank, and a mean weighted by tokens "
        "over no tokens is not defined. Said once",
        "distmetrics: eval/loss (with eval/ppl and eval/gap) is left out of the record of step 6, and of every record "
        "where this recurs: every loss in it was given with 0 tokens (loss_tokens where given) on every rank, and a "
        "mean weighted by tokens over no tokens is not defined. Said once"], out[0]["said"]


def test_lr_is_the_last_value_and_scalars_are_interval_means(run):
    _, results = run
    logs = results[0]["logs"]
    assert logs[4]["train/lr"] == pytest.approx(0.004)
    assert logs[4]["train/grad_scale"] == pytest.approx((0 + 1 + 2) / 3)
    assert logs[8]["probe/max"] == 28.0 and logs[8]["probe/max/max_rank"] == 2


def _scheduled_lr(rank: int, world: int, root: str) -> dict:
    """Every rank's SGD follows one cosine schedule from 0.1, written by the first rank and then by the
    last; then the ranks follow different schedules, then the writer rank passes no lr."""
    import logging

    import numpy
    import torch

    import distmetrics as dm

    said: list = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    out: dict = {"said": said}
    for writer in ("first", "last"):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
        given, returned = {}, {}
        cfg = quiet_config(output_dir=f"{root}/{writer}", log_interval=1, json_log=True, writer_rank=writer)
        with dm.Monitor(cfg) as monitor:
            for step in range(1, STEPS + 1):
                optimizer.step()
                given[step] = scheduler.get_last_lr()[0]
                returned[step] = monitor.step(step, loss=1.0, lr=given[step])["train/lr"]
                scheduler.step()
        written = {r["step"]: r["train/lr"] for r in dm.read_jsonl(f"{root}/{writer}/metrics.jsonl")
                   if r["kind"] == "train"} if monitor.is_writer else None
        out[writer] = {"given": given, "returned": returned, "written": written}
    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        out["different"] = monitor.step(1, loss=1.0, lr=0.1 * (rank + 1))
        out["writer gave none"] = monitor.step(2, loss=1.0, lr=None if rank == 0 else 0.1)
        out["nan elsewhere"] = monitor.step(3, loss=1.0, lr=float("nan") if rank >= 1 else 0.1)
    for nan_at, as_tensor in (((1, 2), False), ((2, 1), True)):  # a NaN between log steps (a float, a tensor)
        with dm.Monitor(quiet_config(log_interval=3)) as monitor:
            for step in (1, 2, 3):
                lr = float("nan") if (rank, step) == nan_at else 0.1
                monitor.step(step, loss=1.0, lr=torch.tensor(lr, dtype=torch.float64) if as_tensor else lr)
    with dm.Monitor(quiet_config(log_interval=3)) as monitor:  # a numpy lr, then a tensor, then a float
        for step, lr in ((1, numpy.float64(0.1)), (2, torch.tensor(math.nan if rank == 2 else 0.1)), (3, 0.1)):
            monitor.step(step, loss=1.0, lr=lr)
    with dm.Monitor(quiet_config(log_interval=3)) as monitor:  # the writer rank passes none; a NaN elsewhere
        for step in (1, 2, 3):
            lr = None if rank == 0 else math.nan if (rank, step) == (1, 2) else 0.1
            out["writer none"] = monitor.step(step, loss=1.0, lr=lr)
    logging.getLogger("distmetrics").removeHandler(handler)
    return out


@pytest.fixture(scope="module")
def scheduled_lr(tmp_path_factory):
    return run_ranks(_scheduled_lr, WORLD, str(tmp_path_factory.mktemp("lr")))


@pytest.mark.parametrize("writer", ["first", "last"])
def test_train_lr_is_written_exactly_as_the_scheduler_gave_it(scheduled_lr, writer):
    """0.1 on 3 ranks is not a mean of them: (0.1 + 0.1 + 0.1) / 3 is 0.10000000000000002."""
    writes = 0 if writer == "first" else WORLD - 1
    assert scheduled_lr[writes][writer]["written"] == scheduled_lr[writes][writer]["given"]
    assert scheduled_lr[writes][writer]["given"][1] == 0.1
    for out in scheduled_lr:
        assert out[writer]["returned"] == out[writer]["given"] == scheduled_lr[writes][writer]["given"]


def test_ranks_with_different_learning_rates_are_said_and_train_lr_is_the_writer_ranks(scheduled_lr):
    assert all(out["different"]["train/lr"] == 0.1 for out in scheduled_lr)
    # the writer rank gave none: the mean of the others' lr, in float64
    assert all(out["writer gave none"]["train/lr"] == 0.1 for out in scheduled_lr)
    assert all(out["nan elsewhere"]["train/lr"] == 0.1 for out in scheduled_lr)
    said = [line for line in scheduled_lr[0]["said"] if "learning rate" in line]
    assert len(said) == 8 and all("writer rank's (rank 0)" in line for line in said[:7]), said
    assert "different learning rates by step 1 (each rank's last in the interval): 0.3 on rank 2 and 0.1 on rank 0" \
        in said[0], said[0]
    assert ("passed no lr to monitor.step in the interval up to step 2 while rank 1 did: train/lr is the mean of the "
            "ranks") in said[1]
    assert said[2] == ("distmetrics: rank 1 passed a learning rate of NaN in the interval up to step 3 (of the "
                       "ranks that did, the lowest); train/lr is the writer rank's (rank 0) at that step: 0.1. "
                       "Said once")
    # a NaN at a step between log steps, where the last lr of the interval is 0.1 on every rank
    assert said[3].startswith("distmetrics: rank 1 passed a learning rate of NaN in the interval up to step 3")
    assert said[4].startswith("distmetrics: rank 2 passed a learning rate of NaN in the interval up to step 3")
    assert said[5].startswith("distmetrics: rank 2 passed a learning rate of NaN in the interval up to step 3")
    assert "passed no lr to monitor.step in the interval up to step 3 while rank 1 did" in said[6]
    assert said[7] == ("distmetrics: rank 1 passed a learning rate of NaN in the interval up to step 3 (of the ranks "
                       "that did, the lowest); train/lr is the mean of the ranks that passed one: 0.1. Said once")
    assert all(out["writer none"]["train/lr"] == 0.1 for out in scheduled_lr)
    assert not any("learning rate" in line for out in scheduled_lr[1:] for line in out["said"])


def test_tokens_per_second_counts_every_rank_once(run):
    _, results = run
    logs = results[0]["logs"]
    tokens = sum(tokens_of(r, s) for r in range(WORLD) for s in range(1, 5))
    assert logs[4]["train/consumed_tokens"] == tokens
    assert logs[8]["train/consumed_tokens"] == sum(tokens_of(r, s) for r in range(WORLD) for s in range(1, 9))


def _fine_step_times(rank: int, world: int, root: str, maxima: int) -> None:
    """Steps of 1234.567891 ms on rank 0 and 1 ns longer on rank 1 (a fake clock); ``maxima`` user ``max``
    metrics beside them (past 256, the MAX pack is decoded with tensor operations, not in Python)."""
    import distmetrics as dm

    cfg = quiet_config(log_interval=10, json_log=True, output_dir=root, log_throughput=True, total_steps=10**7)
    with FakeClock() as clock, dm.Monitor(cfg) as monitor:
        for step in range(1, 21):
            if step > 1:
                clock.advance(1234.567891 + rank * 1e-6)
            for i in range(maxima):
                monitor.record(f"extra/m{i}", float(i), "max")
            monitor.step(step, loss=1.0, tokens=1000 + rank)


@pytest.mark.parametrize("maxima", [0, 300])
def test_step_time_throughput_and_eta_keep_the_slowest_ranks_nanoseconds(tmp_path, maxima):
    """The interval's wall time reaches the record to the nanosecond (an int64 lane of the MAX pack): as a
    float32 max, 1234.567891 ms steps were written 1234.56787109375 (7 digits), and tokens/s and the ETA
    with them. Truth: the fake clock's nanoseconds, in float64."""
    run_ranks(_fine_step_times, 2, str(tmp_path), maxima)
    record = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"][-1]
    interval_s = 10 * round(1234.567892 * 1e6) / 1e9  # the slower rank's steps 11..20
    assert record["step"] == 20 and record["extra/m299" if maxima else "step"] == (299.0 if maxima else 20)
    assert record["train/step_time_ms"] == pytest.approx(interval_s / 10 * 1e3, rel=1e-13)
    assert record["train/tokens_per_sec"] == pytest.approx(10 * 2001 / interval_s, rel=1e-13)
    assert record["train/eta_s"] == pytest.approx((10**7 - 20) * interval_s / 10, rel=1e-13)
    assert not any(key.startswith("_") for key in record), record


def test_no_collective_and_no_item_on_non_log_steps(run):
    _, results = run
    for r in results:
        for step, collectives, items in r["counts"]:
            if step % INTERVAL:
                assert (collectives, items) == (0, 0), f"step {step}"
            else:
                # MAX, SUM (and ALL) packs; the first log step adds the negotiation: one gather of
                # digests and one broadcast per distinct name set (at most one per rank)
                assert collectives <= 3 + (1 + WORLD if step == INTERVAL else 0), f"step {step}: {collectives}"


def test_only_the_writer_rank_creates_files(run):
    root, results = run
    assert sorted(p.name for p in (root / "first" / "rank0").iterdir()) == \
        ["metrics.jsonl", "progress.txt", "tensorboard", "wandb"]
    assert not (root / "first" / "rank1").exists() and not (root / "first" / "rank2").exists()
    assert [r["last_is_writer"] for r in results] == [False, False, True]
    assert (root / "last" / "rank2" / "metrics.jsonl").exists()
    assert not (root / "last" / "rank0").exists() and not (root / "last" / "rank1").exists()


def test_jsonl_parses_line_by_line_and_keeps_nan(run):
    root, _ = run
    import distmetrics as dm

    lines = (root / "first" / "rank0" / "metrics.jsonl").read_text().splitlines()
    raw = [json.loads(line) for line in lines]  # strict JSON: every line parses on its own
    assert [r["kind"] for r in raw] == ["run", "train", "train", "alert", "eval", "end"]
    assert raw[3]["alert"] == "nonfinite_loss" and raw[3]["step"] == 8  # the NaN loss of step 6
    assert raw[0]["world_size"] == WORLD and raw[0]["config"]["log_interval"] == INTERVAL
    records = list(dm.read_jsonl(root / "first" / "rank0" / "metrics.jsonl"))
    train = [r for r in records if r["kind"] == "train"]
    assert train[0]["step"] == 4 and train[0]["train/loss"] == pytest.approx(expected_loss(range(1, 5)))
    assert math.isnan(train[1]["train/loss"])


def test_tensorboard_events_read_back_with_the_jsonl_tags(run):
    root, _ = run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(root / "first" / "rank0" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "eval/loss", "eval/ppl"} <= tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [4, 8]
    assert loss[0].value == pytest.approx(expected_loss(range(1, 5)), rel=1e-6)


def test_wandb_offline_run_reads_back(run):
    root, _ = run
    from tests.wandb_reader import read_offline_run

    wb = read_offline_run(str(root / "first" / "rank0"))
    assert wb["run_name"] == "core-test"
    assert wb["config"]["log_interval"] == INTERVAL
    rows = [row for row in wb["history"] if "train/loss" in row]
    assert [row["step"] for row in rows] == [4, 8]
    assert rows[0]["train/loss"] == pytest.approx(expected_loss(range(1, 5)))
    assert math.isnan(rows[1]["train/loss"])


def test_progress_txt_has_megatrons_format(run):
    root, _ = run
    line = (root / "first" / "rank0" / "progress.txt").read_text().splitlines()[0]
    timestamp, job, gpus, message = line.split("\t")
    assert len(timestamp) == 19 and job.startswith("Job ID: ") and gpus == f"# GPUs: {WORLD}"
    assert message == "Starting job"


def test_a_failing_sink_warns_once_and_the_others_go_on(run):
    root, results = run
    assert "broken" in results[0]["failed_sinks"] and "disk full" in results[0]["failed_sinks"]["broken"]
    records = list((root / "first" / "rank0" / "metrics.jsonl").read_text().splitlines())
    assert len(records) >= 4  # run + 2 train + eval were all written after the failure


def test_perplexity_is_inf_only_where_exp_overflows():
    """eval/ppl was inf from a loss of 709, where exp(709.5) = 1.35e308 is still a float."""
    import distmetrics as dm

    with dm.Monitor(quiet_config()) as monitor:
        assert monitor.log_eval(1, loss=709.5)["eval/ppl"] == math.exp(709.5)
        assert monitor.log_eval(2, loss=709.8)["eval/ppl"] == math.inf
        assert math.isnan(monitor.log_eval(3, loss=math.nan)["eval/ppl"])


def test_eval_is_token_weighted_with_ppl_and_gap(run):
    _, results = run
    ev = results[0]["eval"]
    expected = sum((2.0 + r) * 100 * (r + 1) for r in range(WORLD)) / sum(100 * (r + 1) for r in range(WORLD))
    assert ev["eval/loss"] == pytest.approx(expected)
    assert ev["eval/ppl"] == pytest.approx(math.exp(expected))
    # the gap is to the train loss since the last eval, whose second interval is NaN
    assert math.isnan(ev["eval/gap"])


def _experts_on_an_ep_mesh(rank: int, world: int) -> dict:
    """A model whose expert weight is sharded over the ep dimension of a plain ("dp", "ep") mesh, the
    Monitor given the model only."""
    import logging

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import distmetrics as dm

    seen: list = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    model = torch.nn.Module()
    model.experts = torch.nn.Parameter(distribute_tensor(torch.ones(world, 3), mesh["ep"], [Shard(0)]))
    with dm.Monitor(quiet_config(), model=model) as monitor:
        source = monitor.layout.source
    logging.getLogger("distmetrics").removeHandler(handler)
    return {"source": source, "said": [m for m in seen if "DeviceMesh" in m]}


def test_an_expert_meshs_ep_alone_does_not_make_it_the_jobs_mesh():
    """Found among the parameters, a mesh naming only ep (which may borrow cp and tp ranks) was taken
    as the job's layout mesh, with a warning that its ep may hold cp or tp ranks; the job is read as
    data parallel, unsaid, as it was before ep was said to fold them."""
    for rank, out in enumerate(run_ranks(_experts_on_an_ep_mesh, 2, timeout=120)):
        assert out == {"source": "data-parallel", "said": []}, (rank, out)


def _mesh_dim_names(rank: int, world: int) -> dict:
    import logging

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import distmetrics as dm

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    out = {}
    for names in (("dp", "tp"), ("dp", "tensor_parallel"), ("dp", "model")):
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=names)
        seen.clear()
        with dm.Monitor(quiet_config(log_interval=5, log_throughput=True), device_mesh=mesh) as monitor:
            for step in range(1, 6):
                metrics = monitor.step(step, loss=1.0, tokens=8)
        out[names[1]] = (metrics["train/consumed_tokens"], list(seen))
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    with dm.Monitor(quiet_config(log_interval=5, log_throughput=True), device_mesh=mesh["dp"]) as monitor:
        for step in range(1, 6):  # the sub-mesh FSDP2 is given: its root holds the tp dimension
            metrics = monitor.step(step, loss=1.0, tokens=8)
    out["mesh['dp']"] = metrics["train/consumed_tokens"]
    cp = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "cp"))
    flat = cp["dp_shard", "cp"]._flatten("dp_shard_cp")  # torchtitan's FSDP2 + CP mesh, as many ranks as its root
    with dm.Monitor(quiet_config(log_interval=5, log_throughput=True), device_mesh=flat) as monitor:
        for step in range(1, 6):
            metrics = monitor.step(step, loss=1.0, tokens=8)
    out["dp_shard_cp"] = metrics["train/consumed_tokens"]
    world_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
    unflattened = world_mesh._unflatten(0, (1, world), ("dp", "tp"))  # torchtitan's: its root is the world mesh
    meshes = {names: init_device_mesh("cpu", (1, world)[-len(names):], mesh_dim_names=names)
              for names in (("dp", "TP"), ("dp", "sp"), ("ep", "etp"), ("efsdp", "ep"), ("dp_shard_cp",),
                            ("dp", "expert_tensor_parallel"), ("dp", "tensor_model_parallel"), ("dp_context_parallel",),
                            ("cp", "sp"), ("dp", "sequence_parallel"), ("dp-cp",), ("dp", "moe_ep"),
                            ("dp", "pipeline_model_parallel"), ("dp", "expert_model_parallel"))}
    meshes.update({("world",): world_mesh, ("unflattened",): unflattened, ("unflattened['dp']",): unflattened["dp"]})
    for names, mesh in meshes.items():
        seen.clear()
        with dm.Monitor(quiet_config(log_interval=5, log_throughput=True), device_mesh=mesh) as monitor:
            for step in range(1, 6):
                metrics = monitor.step(step, loss=1.0, tokens=8)
        out[names] = (metrics["train/consumed_tokens"], list(seen))
    try:  # two pipeline dimensions: stages named over one of them summed different modules under one name
        dm.Monitor(quiet_config(), device_mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "pipeline")))
        out["two pp"] = "no error"
    except ValueError as err:
        out["two pp"] = str(err)
    model = torch.nn.Linear(2, 2)  # a model on a ("dp", "model") mesh, no device_mesh= given
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "model"))
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate(), Replicate()]))
    seen.clear()
    with dm.Monitor(quiet_config(log_interval=5, log_throughput=True), model=model) as monitor:
        for step in range(1, 6):
            metrics = monitor.step(step, loss=1.0, tokens=8)
    out["model="] = (metrics["train/consumed_tokens"], list(seen))
    return out


@pytest.fixture(scope="module")
def mesh_names():
    return run_ranks(_mesh_dim_names, 2, timeout=120)[0]


def test_tensor_parallel_mesh_dimensions_count_tokens_once_and_an_unknown_name_is_said(mesh_names):
    """A DeviceMesh dimension named anything but tp/cp/pp was taken for data parallel without a
    word: tensor_parallel doubled tokens/s and MFU on 2 TP ranks. Its alias counts them once; an
    unknown name (model) still counts as data parallel, with a warning naming it."""
    result = mesh_names
    assert result["tp"] == (40.0, []) and result["tensor_parallel"] == (40.0, [])
    tokens, warned = result["model"]
    assert tokens == 80.0 and any("DeviceMesh dimension(s) 'model' are taken for data parallel" in w for w in warned)
    assert result["mesh['dp']"] == 40.0  # 80: the sub-mesh's names alone made both TP ranks data parallel
    assert result["dp_shard_cp"] == 40.0  # 80: the flattened mesh's one name made both CP ranks data parallel


def test_mesh_dimension_names_are_read_in_any_case_and_folded_or_partial_meshes_are_said(mesh_names):
    """TP in capitals, Ulysses' sp and expert TP (etp) share a batch; expert-parallel data ranks (efsdp) and
    torchtitan's world mesh do not, and no warning tells to rename them. A dimension that may fold cp
    into data parallel (dp_shard_cp; torchtitan's ep, which borrows cp) counts each rank, said once.
    torchtitan's meshes, unflattened from a 1-D world mesh, are read as they are (before, through that
    root: 80 tokens); a sub-mesh of one that spans part of the job is said and not read."""
    result = mesh_names
    for names in (("dp", "TP"), ("dp", "sp"), ("unflattened",), ("dp", "expert_tensor_parallel"),
                  ("dp", "tensor_model_parallel"),  # Megatron's long names: expert TP was taken for data parallel
                  ("cp", "sp"), ("dp", "sequence_parallel")):  # a second cp dimension was taken for data parallel
        assert result[names] == (40.0, []), names
    tokens, warned = result[("dp", "pipeline_model_parallel")]  # the last stage counts; stage 0's loss is said
    assert tokens == 40.0 and len(warned) == 1 and "on pipeline rank 0 of 2 is left out" in warned[0], warned
    assert result[("world",)] == (80.0, [])
    for names, tokens in ((("dp_shard_cp",), 80.0), (("efsdp", "ep"), 80.0), (("ep", "etp"), 40.0),
                          (("dp_context_parallel",), 80.0), (("dp-cp",), 80.0), (("dp", "moe_ep"), 80.0),
                          (("dp", "expert_model_parallel"), 80.0)):
        got, warned = result[names]  # a long name's, a hyphen's and an ep variant's fold was not said
        assert got == tokens and len(warned) == 1, (names, got, warned)
        folded = repr(names[0]) if len(names) == 1 else repr(names[1]) if names[1] != "etp" else "'ep'"
        assert f"DeviceMesh dimension(s) {folded} may hold context-, tensor- or pipeline-parallel ranks" in warned[0]
        assert "then pass the mesh with cp, tp and pp as dimensions of their own" in warned[0]
    assert result["two pp"].startswith("device_mesh: dimensions ('pp', 'pipeline') are each a pipeline-parallel")
    tokens, warned = result["model="]  # a model parallelized over an unknown name, no device_mesh=: not said
    assert tokens == 80.0 and len(warned) == 1, warned
    assert "DeviceMesh dimension(s) 'model' are taken for data parallel" in warned[0], warned
    tokens, warned = result[("unflattened['dp']",)]
    assert tokens == 80.0 and len(warned) == 1 and "spans 1 of the Monitor's 2 ranks" in warned[0], warned


def test_a_loss_that_still_requires_grad_is_taken_without_a_torch_warning(tmp_path):
    """The quickstart passes loss=loss, a CPU tensor that requires grad: reading it for the
    non-finite count made torch warn (converting a tensor with requires_grad=True to a scalar)."""
    import warnings

    import torch

    import distmetrics as dm

    weight = torch.ones(3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with dm.Monitor(quiet_config(output_dir=str(tmp_path), log_interval=2)) as monitor:
            for step in (1, 2):
                metrics = monitor.step(step, loss=(weight * 2).sum(), tokens=torch.tensor(4))
    assert metrics["train/loss"] == 6.0


def test_eval_gap_weights_each_interval_by_what_its_train_loss_is_the_mean_of(tmp_path):
    """The train side of eval/gap is the token-weighted loss of the rank-steps that counted since
    the last evaluation: a skipped step's tokens weigh nothing (as in train/loss), and without
    tokens each step weighs 1, so intervals of unequal length are not weighed alike."""
    import distmetrics as dm

    cfg = quiet_config(output_dir=str(tmp_path / "a"), log_interval=10)
    with dm.Monitor(cfg) as monitor:
        for step in range(1, 10):  # skipped (loss-scale warm-up): their loss and tokens do not count
            monitor.step(step, loss=50.0, tokens=1000, skipped=True)
        monitor.step(10, loss=10.0, tokens=1000)
        for step in range(11, 21):
            monitor.step(step, loss=2.0, tokens=1000)
        gap = monitor.log_eval(20, loss=3.0)["eval/gap"]
    assert gap == pytest.approx(3.0 - (10.0 * 1000 + 2.0 * 10_000) / 11_000, rel=1e-12)

    with dm.Monitor(quiet_config(output_dir=str(tmp_path / "b"), log_interval=10)) as monitor:
        for step in range(15, 31):  # a resumed job: steps 15-20 (6, loss 10), then 21-30 (10, loss 2)
            monitor.step(step, loss=10.0 if step <= 20 else 2.0)
        gap = monitor.log_eval(30, loss=3.0)["eval/gap"]
    assert gap == pytest.approx(3.0 - (6 * 10.0 + 10 * 2.0) / 16, rel=1e-12)


def test_eval_tokens_count_once_per_tensor_parallel_group_like_train_tokens(run):
    _, results = run
    for r in results:
        assert r["tp_train"] == 200  # two steps of one 100-token batch
        assert r["tp_eval"]["eval/tokens_per_sec"] == pytest.approx(100 / 0.5)  # not 3 × that


# --- names the record's own keys, and names of two kinds of record -------------------------------
@pytest.mark.parametrize("name", ["step", "kind", "time"])
def test_a_metric_named_as_a_record_key_is_refused(tmp_path, name):
    """monitor.record("step", 3.0) replaced the record's own step in metrics.jsonl (its kind with
    "kind"): the line read {"kind": 1.0, "step": 3.0, ...}."""
    import distmetrics as dm

    with dm.Monitor(quiet_config(output_dir=str(tmp_path), log_interval=1, json_log=True)) as monitor:
        with pytest.raises(ValueError, match=rf"metric name '{name}' is refused: every record's own keys"):
            monitor.record(name, 3.0)
        monitor.step(1, loss=1.0)
    last = list(dm.read_jsonl(tmp_path / "metrics.jsonl"))[-2]  # the end record last
    assert last["kind"] == "train" and last["step"] == 1


@pytest.mark.parametrize("name", ["loss//a", " ", "a\nb", "tab\tname"])
def test_a_metric_name_with_an_empty_part_blank_or_a_control_character_is_refused(name):
    """``train//a``, blank text and a newline (which split the console line) were accepted as names."""
    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        with pytest.raises(ValueError, match=r"is refused: it (has an empty part|is blank|holds a control)"):
            monitor.record(name, 3.0)
        assert monitor.step(1, loss=1.0)["train/loss"] == 1.0


class _RecordKeys:
    """A user's collector whose samples are named 'step' and, in a vector, 'time' beside one of its own."""

    name, after, writes = "mine", (), ()

    def __init__(self, rank: int, misnamed_on: tuple) -> None:
        self.rank, self.misnamed_on = rank, misnamed_on

    def take_samples(self, ctx):
        import torch

        from distmetrics.reduce import Sample

        vector = Sample("mine/v", torch.tensor([1.0, 2.0]), "max", names=("mine/a", "time"))
        if self.rank in self.misnamed_on:
            return [Sample("step", 7.0, "mean"), vector, Sample("mine/ok", 1.0 + self.rank, "mean")]
        return [Sample("mine/ok", 1.0 + self.rank, "mean")]

    def finalize(self, metrics, ctx):
        return []

    def close(self):
        pass


def _collector_record_keys(rank: int, world: int, root: str, misnamed_on: tuple = (0, 1)) -> dict:
    import distmetrics as dm

    with dm.Monitor(quiet_config(output_dir=root, log_interval=1, json_log=True, hang_timeout_s=2.0),
                    collectors=[_RecordKeys(rank, misnamed_on)]) as monitor:
        try:
            monitor.step(1, loss=1.0 + rank)
            return {"raised": None}
        except ValueError as err:
            return {"raised": str(err)}


def test_a_collectors_sample_named_as_a_record_key_is_left_out_and_raised_after_the_record(tmp_path):
    """A collector's Sample("step", 7.0) was written over the record's own step ("step": 7.0 in
    metrics.jsonl, whose readers then skipped the line); the user's names were refused, the
    collectors' were not. Left out on every rank, the record written, then raised naming both."""
    import distmetrics as dm

    for result in run_ranks(_collector_record_keys, 2, str(tmp_path), timeout=120):
        assert result["raised"] == (
            "the 'mine' collector handed over a sample named 'step'; the 'mine' collector handed over a vector "
            "sample 'mine/v' with an element named 'time': every record's own keys are 'kind', 'step', 'time', which "
            "a metric of that name replaced in metrics.jsonl; give it a prefix (e.g. 'mine/step'). The record was "
            "written without it"), result
    (record,) = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert record["step"] == 1 and isinstance(record["time"], str)
    assert record["train/loss"] == 1.5 and record["mine/ok"] == 1.5 and "mine/a" not in record  # means of 1 and 2


def test_a_sample_named_as_a_record_key_on_one_rank_raises_on_every_rank(tmp_path):
    """Only the rank whose collector handed it over raised; the other went on to its next call and
    waited there, until the arrival check said the first had left."""
    import distmetrics as dm

    results = run_ranks(_collector_record_keys, 2, str(tmp_path), (1,), timeout=120)
    assert "the 'mine' collector handed over a sample named 'step'" in results[1]["raised"], results[1]
    assert results[0]["raised"] == (
        "rank 1's collectors handed over a sample named as one of a record's own keys ('kind', 'step', 'time'), "
        "which that rank's error names. The record was written without it"), results[0]
    (record,) = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert record["step"] == 1 and record["mine/ok"] == 1.5 and not any(k.startswith("_") for k in record)


class _Flaky:
    """A collector of the user's whose take_samples raises at step 2 on rank 1."""

    name, after, writes = "flaky", (), ("flaky/",)

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def take_samples(self, ctx):
        import distmetrics as dm

        if ctx.step == 2 and self.rank == 1:
            raise RuntimeError("a transient failure")
        return [dm.Sample("flaky/steps", float(ctx.steps), "max")]

    def finalize(self, metrics, ctx):  # not called where take_samples raised on a rank: KeyError then
        metrics["flaky/seen"] = metrics["flaky/steps"]
        return []

    def close(self):
        pass


class _Undeclared(_Flaky):
    """A collector of the user's with no writes whose take_samples raises at step 4 on rank 0, the writer."""

    name, writes = "undeclared", ()

    def take_samples(self, ctx):
        import distmetrics as dm

        if ctx.step == 4 and self.rank == 0:
            raise RuntimeError("a failure on the writer")
        return [dm.Sample("und/ranks", 1.0, "sum")] + ([dm.Sample("und/rank1", 5.0, "sum")] if self.rank else [])

    def finalize(self, metrics, ctx):
        return []


def _collector_raises(rank: int, world: int, root: str) -> dict:
    import distmetrics as dm

    said = []
    config = quiet_config(output_dir=root, log_interval=2, json_log=True, log_throughput=True, hang_timeout_s=20.0)
    with dm.Monitor(config, collectors=[_Flaky(rank), _Undeclared(rank)]) as monitor:
        for step in range(1, 7):
            monitor.record("mine/n", 1.0, "sum")
            try:
                monitor.step(step, loss=10.0 * step, tokens=10 ** step)
            except RuntimeError as err:
                said.append((step, type(err).__name__, str(err)))
    return {"said": said}


def test_a_collector_whose_take_samples_raises_leaves_the_record_written_without_it(tmp_path):
    """A collector of the user's raising in take_samples (on rank 1, at step 2) lost the interval's values
    the collectors before it had taken (their intervals begun again) and the record with them, counted
    nowhere: the step-4 record then mixed 2 steps of loss with 4 of calls. Now the record is written
    without that collector's samples and its error raised after it, on every rank, naming it. Its values
    from the ranks where it did not raise were written under its names (rank 0's alone: a sum of part of
    the ranks, with no mark) and its finalize read them: now they are left out on every rank, where it
    declares them in writes, where it has handed them over on the writer before, and where another rank
    sent them alone (``und/rank1``: the ranks agree each name with its writer)."""
    import distmetrics as dm

    results = run_ranks(_collector_raises, 2, str(tmp_path), timeout=120)
    (step, kind, message), (step4, kind4, message4) = results[1]["said"]
    assert (step, kind) == (2, "CollectorFailed") and message == (
        "the 'flaky' collector's take_samples raised RuntimeError: a transient failure; the record of step 2 was "
        "written without its samples"), message
    assert (step4, kind4) == (4, "CollectorFailed") and message4.startswith("rank 0's collector 'undeclared' raised")
    (step, kind, message), (step4, kind4, message4) = results[0]["said"]
    assert (step, kind) == (2, "CollectorFailed") and message == (
        "rank 1's collector 'flaky' raised in take_samples, which that rank's error names; the record was written "
        "without its samples"), message
    assert (step4, kind4) == (4, "CollectorFailed") and message4.startswith("the 'undeclared' collector's")
    records = {r["step"]: r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"}
    assert sorted(records) == [2, 4, 6]
    # token-weighted means of each record's own 2 steps: (10*10 + 20*100) / 110 and (30*1e3 + 40*1e4) / 11000
    assert records[2]["train/loss"] == pytest.approx(2100 / 110) and records[2]["mine/n"] == 4.0
    assert records[4]["train/loss"] == pytest.approx(430000 / 11000) and records[4]["mine/n"] == 4.0
    assert not any(key.startswith("flaky/") for key in records[2]), records[2]  # rank 0's alone is not the metric
    assert records[4]["flaky/steps"] == 2.0 and records[4]["flaky/seen"] == 2.0
    assert records[2]["und/ranks"] == 2.0 and "und/ranks" not in records[4] and records[6]["und/ranks"] == 2.0
    assert records[2]["und/rank1"] == records[6]["und/rank1"] == 5.0 and "und/rank1" not in records[4], records[4]
    assert records[4]["train/consumed_tokens"] == 2 * (10 + 100 + 1000 + 10000)


class _Weighted:
    """A collector of the user's whose means carry tensor weights: at step 2 rank 1's hold a negative one (or NaN)."""

    name, after, writes = "weighted", (), ("w/",)

    def __init__(self, rank: int, bad: float) -> None:
        self.rank, self.bad = rank, bad

    def take_samples(self, ctx):
        import torch

        import distmetrics as dm

        weights = torch.tensor([1.0, 3.0])
        if ctx.step == 2 and self.rank == 1:
            weights = torch.tensor([1.0, self.bad])
        return [dm.Sample("w/v", torch.tensor([2.0, 4.0]) + self.rank, "mean", weight=weights, names=("w/a", "w/b")),
                dm.Sample("w/s", 1.0 + self.rank, "mean", weight=weights[1])]

    def finalize(self, metrics, ctx):
        return []

    def close(self):
        pass


def _bad_tensor_weights(rank: int, world: int, root: str, bad: float) -> list:
    import distmetrics as dm

    said = []
    config = quiet_config(output_dir=root, log_interval=1, json_log=True, hang_timeout_s=20.0)
    with dm.Monitor(config, collectors=[_Weighted(rank, bad)]) as monitor:
        for step in (1, 2, 3):
            try:
                monitor.step(step, loss=1.0)
                said.append(None)
            except dm.CollectorFailed as err:
                said.append(str(err))
    return said


@pytest.mark.parametrize("bad", [-3.0, math.nan])
def test_a_collectors_tensor_weight_that_is_negative_or_nan_on_one_rank_is_refused_on_every_rank(tmp_path, bad):
    """A mean's weight given as a tensor is not read at the call (a device sync): rank 1's -3 made w/b's mean
    (4·3 + 5·(-3)) / 0, and its NaN a NaN, written without a word. Flagged on the device, in a MAX lane of the
    log step: the record is written without the collector's samples, and every rank raises naming it and the rank."""
    import distmetrics as dm

    root = tmp_path / "run"
    for rank, said in enumerate(run_ranks(_bad_tensor_weights, 2, str(root), bad, timeout=120)):
        assert said[0] is None and said[2] is None, (rank, said)
        assert said[1] is not None and said[1].startswith(
            "the 'weighted' collector on rank 1 gave a mean's weight as a tensor holding NaN, inf or a negative "
            "value in the samples of step 2"), (rank, said)
    records = [r for r in dm.read_jsonl(root / "metrics.jsonl") if r["kind"] == "train"]
    for record in (records[0], records[2]):  # (2·1 + 3·1) / 2, (4·3 + 5·3) / 6, (1·3 + 2·3) / 6
        assert (record["w/a"], record["w/b"], record["w/s"]) == (2.5, 4.5, 1.5), record
    assert records[1]["train/loss"] == 1.0 and not [key for key in records[1] if key.startswith("w/")], records[1]


class _Weightless:
    """A collector of the user's whose means weigh 0 on every rank: a scalar at steps 2 and 3, a vector's first
    element at step 3, and on rank 1 alone a name no other rank sends (at step 3); at step 1 the scalar's
    tensor weight is -1 on rank 1 and 1 on rank 0 (a bad weight, summed to 0: refused, not weightless)."""

    name, after, writes = "weightless", (), ("z/",)

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def take_samples(self, ctx):
        import torch

        import distmetrics as dm

        bad = torch.tensor(-1.0 if self.rank == 1 else 1.0)
        samples = [dm.Sample("z/s", 2.0 + self.rank, "mean", weight=0.0 if ctx.step >= 2 else bad),
                   dm.Sample("z/v", torch.tensor([1.0, 3.0]), "mean", names=("z/a", "z/b"),
                             weight=torch.tensor([0.0 if ctx.step == 3 else 1.0, 1.0]))]
        if self.rank == 1 and ctx.step == 3:
            samples.append(dm.Sample("z/one", 7.0, "mean", weight=0))
        return samples

    def finalize(self, metrics, ctx):
        return []

    def close(self):
        pass


def _weightless_samples(rank: int, world: int) -> tuple:
    import logging

    import distmetrics as dm

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    try:
        with dm.Monitor(quiet_config(log_interval=1), collectors=[_Weightless(rank)]) as monitor:
            try:
                monitor.step(1)
            except dm.CollectorFailed:  # its record written without the collector's values
                keys = [sorted(k for k in monitor.last_metrics if k.startswith("z/"))]
            keys += [sorted(k for k in monitor.step(step) if k.startswith("z/")) for step in (2, 3, 4)]
    finally:
        logging.getLogger("distmetrics").removeHandler(handler)
    return keys, [message for message in said if "weightless" in message]


def test_a_collectors_mean_whose_weights_sum_to_0_is_left_out_and_said_once_per_name():
    """A user's collector's mean weighing 0 on every rank was left out of the record without a word (the
    README said so for monitor.record alone). Said once per name, by each rank that sent it; not for a bad
    weight refused, which took up the name's one saying (the real one at step 2 went unsaid)."""
    for rank, (keys, said) in enumerate(run_ranks(_weightless_samples, 2, timeout=120)):
        assert keys == [[], ["z/a", "z/b"], ["z/b"], ["z/a", "z/b"]], (rank, keys)
        lead = "distmetrics: the 'weightless' collector's mean"
        third = f"{lead} 'z/a' is left out" if rank == 0 else f"{lead} values 'z/a', 'z/one' are left out"
        expected = [f"{lead} 'z/s' is left out of the record of step 2", f"{third} of the record of step 3"]
        assert [message.split(", and of every")[0] for message in said] == expected, (rank, said)


class _Refused(_Flaky):
    """A collector of the user's that hands over, on rank 1 at log steps 4-14, one sample each that the
    reduction refuses (on rank 0, and at steps 2 and 16, it is well)."""

    def take_samples(self, ctx):
        import torch

        import distmetrics as dm

        ok = [dm.Sample("flaky/steps", float(ctx.steps), "max"), dm.Sample("_flaky/raw", 1.0, "sum")]  # a lane of
        if self.rank == 0 or ctx.step not in _REFUSED:  # its own: read by its finalize
            return ok
        return {4: [dm.Sample("flaky/steps", 1.0, "mean")], 6: ok + ok[:1],
                8: [dm.Sample("flaky/v", torch.ones(2), "sum", names=("flaky/v/a", "flaky/v/a"))],
                10: ok + [dm.Sample("_train/tokens", 5.0, "sum")], 12: ok + [dm.Sample("flaky/\ud800", 1.0, "max")],
                14: ok + [{"flaky/x": 1.0}]}[ctx.step]

    def finalize(self, metrics, ctx):
        metrics["flaky/raw"] = metrics.pop("_flaky/raw")
        return []


_REFUSED = {4: "reduced as 'max' before and now as 'mean'", 6: "'flaky/steps' was handed over twice",
            8: "'flaky/v' names an element twice", 10: "'_train/tokens' is refused: names are non-empty, do not start "
            "with '_'", 12: "is not valid UTF-8", 14: "returned a dict ({'flaky/x': 1.0}), not a Sample"}


def _collector_refused(rank: int, world: int, root: str) -> dict:
    import distmetrics as dm

    said = []
    config = quiet_config(output_dir=root, log_interval=2, json_log=True, log_throughput=True, hang_timeout_s=60.0)
    with dm.Monitor(config, collectors=[_Refused(rank)]) as monitor:
        for step in range(1, 17):
            try:
                monitor.step(step, loss=float(step + rank), tokens=10)
            except RuntimeError as err:
                said.append((step, type(err).__name__, str(err)))
    return {"said": said}


def test_samples_the_reduction_would_refuse_on_one_rank_fail_that_collector_on_every_rank(tmp_path):
    """A user's collector whose sample changed its reduce kind, came twice, named a vector's element twice
    (checks the reduction makes before its collectives, on the rank holding it) raised there alone: the
    other rank waited hang_timeout_s for it and the record was lost. A name starting with '_' (the Monitor's
    lanes: '_train/tokens' made every log step raise, another vanished), one no valid UTF-8 (W&B turned off
    for good) and no Sample at all are refused too. Each now fails that collector as one that raised: the
    record is written without its samples and CollectorFailed raised on every rank."""
    import distmetrics as dm

    results = run_ranks(_collector_refused, 2, str(tmp_path), timeout=120)
    assert [(step, kind) for step, kind, _ in results[0]["said"]] == [(s, "CollectorFailed") for s in _REFUSED]
    assert [(step, kind) for step, kind, _ in results[1]["said"]] == [(s, "CollectorFailed") for s in _REFUSED]
    for step, _, message in results[1]["said"]:
        assert "the 'flaky' collector's take_samples raised" in message and _REFUSED[step] in message, message
    records = {r["step"]: r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"}
    assert sorted(records) == list(range(2, 17, 2))
    for step, record in records.items():  # both ranks' two steps: (s-1 + s + s + s+1) / 4 = s
        assert record["train/loss"] == step and record["train/consumed_tokens"] == 20 * step, record
        assert not any(k.startswith(("_", "flaky/v")) for k in record)
        if step in _REFUSED:  # rank 0's values alone are not the metric: left out, its finalize not called
            assert not any(k.startswith("flaky/") for k in record), record
        else:
            assert record["flaky/steps"] == 2.0 and record["flaky/raw"] == 2.0, record


class _LosesARank(_Flaky):
    """A collector of the user's whose own collective in take_samples found a rank gone."""

    def take_samples(self, ctx):
        import distmetrics as dm

        raise dm.HangError("rank 1 did not come to my gather")


def test_a_hang_error_in_a_collectors_take_samples_comes_at_once_as_it_is(tmp_path):
    """A rank gone is no failure of one collector: the log step's reduction would wait for it again."""
    import distmetrics as dm

    config = quiet_config(output_dir=str(tmp_path), log_interval=1, json_log=True)
    with pytest.raises(dm.HangError, match="rank 1 did not come to my gather"):
        with dm.Monitor(config, collectors=[_LosesARank(0)]) as monitor:
            monitor.step(1, loss=1.0)
    assert [r["kind"] for r in dm.read_jsonl(tmp_path / "metrics.jsonl")] == ["run", "end"]


def _record_then_eval(rank: int, world: int, order: str) -> dict:
    import distmetrics as dm

    said = []
    with dm.Monitor(quiet_config(log_interval=2)) as monitor:
        calls = [lambda: monitor.record("eval/acc", 7.0 + 2 * rank),
                 lambda: monitor.log_eval(2, loss=1.0, acc=0.5 + rank)]
        for call in (calls if order == "record first" else calls[::-1]):
            try:
                call()
            except ValueError as err:
                said.append(str(err))
        monitor.step(1, loss=1.0)
        train = monitor.step(2, loss=1.0)
    return {"said": said, "train": train}


@pytest.mark.parametrize("order", ["record first", "log_eval first"])
def test_one_name_in_train_and_eval_records_is_refused_on_every_rank(order):
    """monitor.record("eval/acc") beside log_eval(acc=...): both reduce with mean, so the name passed,
    and the train records carried the user's 8.0 under the tag whose eval points are the eval
    accuracy (1.0): one tag, two meanings."""
    results = run_ranks(_record_then_eval, 2, order)
    for r in results:
        assert len(r["said"]) == 1 and "is written in" in r["said"][0] and "give it another name" in r["said"][0]
        assert ("eval/acc" in r["train"]) == (order == "record first")  # the first writer keeps it


def _split_record_and_eval(rank: int, world: int, root: str) -> dict:
    """``eval/acc`` from monitor.record on rank 0 and from log_eval(acc=...) on rank 1, in two jobs: the
    train record written first ("train first"), or the eval record ("eval first"); every error kept."""
    import distmetrics as dm

    said: dict = {}

    def call(job: str, made) -> None:
        try:
            made()
        except ValueError as err:
            said.setdefault(job, []).append(str(err))

    for job in ("train first", "eval first"):
        with dm.Monitor(quiet_config(output_dir=f"{root}/{job}", log_interval=2, json_log=True)) as monitor:
            evaluate = partial(monitor.log_eval, loss=2.0 + rank, **({"acc": 0.5} if rank == 1 else {}))
            if job == "eval first":
                call(job, partial(evaluate, 0))
            for step in range(1, 5):
                if rank == 0:
                    monitor.record("eval/acc", 7.0)
                call(job, partial(monitor.step, step, loss=1.0 + rank))
            if job == "train first":
                call(job, partial(evaluate, 4))
    return said


def test_one_name_in_train_records_on_one_rank_and_eval_records_on_another_is_refused_on_every_rank(tmp_path):
    """Each rank's own check saw its own calls only: monitor.record("eval/acc") on rank 0 and
    log_eval(acc=...) on rank 1 passed, and metrics.jsonl's eval/acc held rank 0's 7.0 in train
    records beside rank 1's 0.5 in eval records. The names meet where the ranks agree on them: the
    record written first keeps the name, the other is written without it and raises on every rank,
    at every reduction that sends it."""
    import distmetrics as dm

    results = run_ranks(_split_record_and_eval, 2, str(tmp_path), timeout=180)
    assert results[0] == results[1], results
    said = results[0]
    train_use = "metric 'eval/acc' (mean) from rank 0 in train records (monitor.step, monitor.record)"
    eval_use = "metric 'eval/acc' (mean) from rank 1 in eval records (monitor.log_eval)"
    clash = ": one tag would hold both kinds of record (values of one at the steps of the other); give one of them " \
            "another name (left out of this record)"
    assert said.get("train first") == [f"{eval_use} would write 'eval/acc', which {train_use} writes already{clash}"]
    assert said.get("eval first") == [f"{train_use} would write 'eval/acc', which {eval_use} writes already{clash}"] * 2
    for job, kept in (("train first", "train"), ("eval first", "eval")):
        records = [r for r in dm.read_jsonl(tmp_path / job / "metrics.jsonl") if r["kind"] in ("train", "eval")]
        assert [(r["kind"], r["step"]) for r in records] == (
            [("train", 2), ("train", 4), ("eval", 4)] if kept == "train" else [("eval", 0), ("train", 2), ("train", 4)])
        assert {r["kind"] for r in records if "eval/acc" in r} == {kept}, records  # one tag, one kind of record
        assert [r["eval/acc"] for r in records if "eval/acc" in r] == ([7.0, 7.0] if kept == "train" else [0.5])
        assert all(r["train/loss"] == 1.5 for r in records if r["kind"] == "train")  # the rest is written
        assert all(r["eval/loss"] == 2.5 for r in records if r["kind"] == "eval")


# --- names another writer writes: a collector's writes and samples --------------------------------
class _Named:
    """A user's collector: ``mine/ok`` on every rank and, on the ranks in ``on``, ``samples``
    ((name, value, reduce)); ``writes`` and ``after`` as given."""

    name = "mine"

    def __init__(self, rank: int, samples=(), on=(0, 1), writes=(), after=()) -> None:
        self.rank, self.samples, self.on, self.writes, self.after = rank, samples, on, writes, after

    def take_samples(self, ctx):
        from distmetrics.reduce import Sample

        own = [Sample("mine/ok", 1.0 + self.rank, "mean")]
        return own + ([Sample(*sample) for sample in self.samples] if self.rank in self.on else [])

    def finalize(self, metrics, ctx):
        if self.after == ("memory",):  # derived from the memory collector's value, under its names
            metrics["memory/host_rss_mib"] = metrics["memory/host_rss_gib"] * 1024
        return []

    def close(self):
        pass


OTHER_WRITERS = {"train/step_time_ms": "the 'throughput' collector",
                 "train/tokens_per_sec": "the 'throughput' collector",
                 "train/consumed_tokens": "the 'throughput' collector", "health/loss_spike": "the 'health' collector",
                 "stragglers/score_min": "the 'timers' collector", "eval/loss": "monitor.log_eval(loss=...)"}
"""Names a collector writes in finalize (or log_eval in eval records), and who: a user's sample of
that name was overwritten there, its own ``/max_rank`` left in the record."""


def _other_writers_names(rank: int, world: int, root: str) -> dict:
    import distmetrics as dm

    out: dict = {}
    # writes overlapping the memory collector's, given on rank 1 only
    try:
        dm.Monitor(quiet_config(output_dir=f"{root}/overlap", json_log=True, log_memory=True, hang_timeout_s=10.0),
                   collectors=[_Named(rank, writes=("memory/",))] if rank == 1 else [])
        out["overlap"] = None
    except ValueError as err:
        out["overlap"] = str(err)
    # the same names shared by a collector that runs after the memory collector and only derives values
    with dm.Monitor(quiet_config(log_interval=1, log_memory=True),
                    collectors=[_Named(rank, writes=("memory/",), after=("memory",))]) as monitor:
        out["derived"] = monitor.step(1, loss=1.0)
    # samples under other writers' names, handed over on rank 1 only, at two log steps
    out["raised"] = []
    samples = [("train/step_time_ms", 123.0, "max"), ("health", 7.0, "minmax")]
    with dm.Monitor(quiet_config(output_dir=f"{root}/samples", json_log=True, log_interval=2, log_throughput=True,
                                 hang_timeout_s=10.0), collectors=[_Named(rank, samples, on=(1,))]) as monitor:
        for step in (1, 2, 3, 4):
            try:
                monitor.step(step, loss=1.0, tokens=10)
            except ValueError as err:
                out["raised"].append((step, str(err)))
    # each name of another writer, on both ranks
    out["each"] = {}
    for name in OTHER_WRITERS:
        with dm.Monitor(quiet_config(log_interval=2, log_throughput=True, straggler_window=2, hang_timeout_s=10.0),
                        collectors=[_Named(rank, [(name, 99.0, "max")])]) as monitor:
            monitor.step(1, loss=1.0, tokens=10)
            try:
                monitor.step(2, loss=1.0, tokens=10)
            except ValueError as err:
                out["each"][name] = (str(err), monitor.last_metrics)
    return out


@pytest.fixture(scope="module")
def other_writers(tmp_path_factory):
    root = tmp_path_factory.mktemp("other_writers")
    return root, run_ranks(_other_writers_names, 2, str(root), timeout=180)


def test_collectors_whose_writes_overlap_are_refused_at_construction_on_every_rank(other_writers):
    """A collector declaring writes=("memory/",) beside log_memory=True was accepted (the first
    writer kept the names without a word); then every log step raised "metric(s)
    ['memory/host_rss_gib'] appear twice in one reduction" and no train record was ever written.
    Refused at Monitor() on both ranks, though only rank 1 was given it, and the folder let go."""
    import distmetrics as dm

    root, results = other_writers
    for result in results:
        assert result["overlap"].startswith("distmetrics cannot start: rank 1: the 'mine' collector writes 'memory/', "
                                            "which the 'memory' collector writes too"), result["overlap"]
    with dm.Monitor(quiet_config(output_dir=str(root / "overlap"), json_log=True)):  # the folder is free
        pass


def test_a_collector_that_runs_after_another_may_derive_values_under_its_names(other_writers):
    """Sharing names is for a collector that names the other in ``after`` (the timers' stragglers/
    beside the stragglers collector's): it runs after it and writes around what it wrote."""
    _, results = other_writers
    for result in results:
        derived = result["derived"]
        assert derived["memory/host_rss_mib"] == derived["memory/host_rss_gib"] * 1024 > 0
        assert derived["mine/ok"] == 1.5


def test_a_collectors_sample_under_another_writers_name_is_left_out_and_raised_on_every_rank(other_writers):
    """Sample("train/step_time_ms", 123.0, "max") was written over by the throughput collector's
    finalize, leaving its train/step_time_ms/max_rank in the record; "health" as minmax wrote
    health/max under the health collector's names. Only rank 1 hands them over; both ranks raise
    at each log step, after the record is written without them."""
    import distmetrics as dm

    root, results = other_writers
    assert [step for step, _ in results[1]["raised"]] == [2, 4] == [step for step, _ in results[0]["raised"]]
    for _, said in results[1]["raised"]:
        assert said.startswith("the 'mine' collector handed over a sample 'train/step_time_ms', which the 'throughput' "
                               "collector writes; the 'mine' collector handed over a sample 'health' (minmax, which "
                               "writes 'health/max'), which the 'health' collector writes: a collector sends the names "
                               "it declares in its writes"), said
    for _, said in results[0]["raised"]:
        assert said == ("rank 1's collectors handed over a sample named as a name another writer writes, which that "
                        "rank's error names. The record was written without it")
    records = [r for r in dm.read_jsonl(root / "samples" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        assert record["mine/ok"] == 1.5 and record["train/step_time_ms"] != 123.0  # the throughput collector's
        assert record["train/consumed_tokens"] == 40 * record["step"] // 2  # 10 tokens per rank and step
        assert not any(k.startswith(("train/step_time_ms/", "health/max", "health/min", "_")) for k in record), record


@pytest.mark.parametrize("name", OTHER_WRITERS)
def test_each_name_another_writer_writes_is_refused_naming_it(other_writers, name):
    _, results = other_writers
    for result in results:
        said, record = result["each"][name]
        assert said.startswith(f"the 'mine' collector handed over a sample {name!r}, which {OTHER_WRITERS[name]} "
                               "writes"), said
        assert record.get(name) != 99.0 and f"{name}/max_rank" not in record and record["mine/ok"] == 1.5


def test_a_collectors_names_are_looked_up_only_when_they_change(monkeypatch):
    """The check runs when a collector's names (or the names written) change, not per name at every
    log step: a model of thousands of names pays one tuple comparison per collector."""
    import distmetrics as dm
    from distmetrics.names import NameRegistry

    looked_up = []
    writer_of = NameRegistry.writer_of
    monkeypatch.setattr(NameRegistry, "writer_of", lambda self, name: looked_up.append(name) or writer_of(self, name))
    collector = _Named(0, [("mine/vector", 1.0, "sum")])
    with dm.Monitor(quiet_config(log_interval=1), collectors=[collector]) as monitor:
        counts = []
        for step in (1, 2, 3):
            monitor.step(step, loss=1.0)
            counts.append(len(looked_up))
        monitor.record("other/name", 1.0)  # a name joins the registry: looked up again, once
        monitor.step(4, loss=1.0)
        monitor.step(5, loss=1.0)
        counts.append(len(looked_up))
    # a change of names looks each name up once more (the collectors' checks, and the reduction's clash check of
    # the names it builds a layout for, which a negotiation makes on more than one rank)
    assert counts[1:3] == [counts[0]] * 2 and counts[3] > counts[2], (counts, looked_up)
    assert looked_up[counts[2]:].count("other/name") >= 1 and "other/name" not in looked_up[:counts[2]]


def test_the_built_in_collectors_share_names_only_with_one_they_run_after():
    """The timers write train/step_time_ms only where the throughput collector wrote none, and
    stragglers/<timer>/rank beside the stragglers collector's scores: the only overlaps among the
    built-in collectors' writes (and log_eval's names), each between one and a collector it names in
    ``after``. Without that, the same overlap is refused."""
    from types import SimpleNamespace

    import distmetrics as dm
    from distmetrics.collectors import planned_collectors
    from distmetrics.collectors.stragglers import StragglerCollector
    from distmetrics.collectors.writes import check_writes
    from distmetrics.evaluation import EvalLog
    from distmetrics.tensor_stats.inspector import TensorInspector

    config = dm.MetricsConfig(log_energy=True, log_gpu_telemetry=True, straggler_window=2)
    kinds = [kind for kind, _ in planned_collectors(config, SimpleNamespace(world_size=2), model=object())]
    kinds.append(TensorInspector)
    assert {k.name for k in kinds} == {"train", "timers", "throughput", "memory", "energy", "gpu_telemetry", "norms",
                                       "health", "losses", "moe", "stragglers", "tensor_stats"}
    writers = [(k.name, k.after, k.writes) for k in kinds] + [("log_eval", (), EvalLog.writes)]

    def overlap(a: str, b: str) -> bool:
        return a == b or (a.endswith("/") and b.startswith(a)) or (b.endswith("/") and a.startswith(b))

    shared = {(x[0], y[0]) for i, x in enumerate(writers) for y in writers[i + 1:]
              if any(overlap(a, b) for a in x[2] for b in y[2])}
    assert shared == {("timers", "throughput"), ("timers", "stragglers")}
    for first, second in shared:
        after = {name: after for name, after, _ in writers}
        assert second in after[first] or first in after[second]
    check_writes(kinds, [("monitor.log_eval", EvalLog.writes)])

    class Alone(StragglerCollector):
        after = ()

    with pytest.raises(ValueError, match="^the 'stragglers' collector writes 'stragglers/', which the 'timers' "
                                         "collector writes too"):
        check_writes([Alone if kind is StragglerCollector else kind for kind in kinds])


def test_a_collectors_writes_over_log_evals_names_are_said_of_the_collector():
    """writes=("eval/",) was refused with "give monitor.log_eval names of its own": the user's collector
    is the one to rename."""
    from distmetrics.collectors.writes import check_writes
    from distmetrics.evaluation import EvalLog

    class Mine(_Flaky):
        name, writes = "mine", ("eval/",)

    with pytest.raises(ValueError, match="^the 'mine' collector writes 'eval/' and monitor.log_eval writes "
                                         "'eval/.*give the 'mine' collector names of its own \\(e.g. under 'mine/'\\)"):
        check_writes([Mine], [("monitor.log_eval", EvalLog.writes)])


def test_exact_names_of_ones_own_pass_and_a_built_in_prefix_is_its_collectors_whole():
    """README (Adding a metric): writes=("train/data_wait_ms",) is written; writes=("train/",) is refused
    at Monitor() (it covers train/loss); a sample under timers/ is refused with every timer off."""
    import distmetrics as dm

    sample = [("train/data_wait_ms", 1.5, "mean")]
    with dm.Monitor(quiet_config(log_interval=1), collectors=[_Named(0, sample, on=(0,),
                                                                     writes=("train/data_wait_ms",))]) as monitor:
        assert monitor.step(1, loss=1.0)["train/data_wait_ms"] == 1.5
    with pytest.raises(ValueError, match="the 'mine' collector writes 'train/' and the 'train' collector writes"):
        dm.Monitor(quiet_config(), collectors=[_Named(0, sample, on=(0,), writes=("train/",))])
    with dm.Monitor(quiet_config(log_interval=1), collectors=[_Named(0, [("timers/x", 1.0, "max")], on=(0,))]) as m:
        with pytest.raises(ValueError, match="a sample 'timers/x', which the 'timers' collector writes"):
            m.step(1, loss=1.0)


SWITCHED_OFF = {"memory/foo": "memory", "energy/total_j": "energy", "power/mean_w": "energy",
                "gpu/temperature_c": "gpu_telemetry", "tensor_stats/fc1/activation/max": "tensor_stats",
                "train/tokens_per_sec": "throughput", "train/consumed_tokens": "throughput"}
"""A name of each built-in collector a switch turns off, and the collector that owns it."""


def _names_under_switched_off_collectors(rank: int, world: int) -> dict:
    import distmetrics as dm

    out: dict = {"record": {}}
    off = dict(log_throughput=False, log_memory=False, log_energy=False, log_gpu_telemetry=False, hang_timeout_s=10.0)
    with dm.Monitor(quiet_config(log_interval=1, **off)) as monitor:
        for name in (*SWITCHED_OFF, "eval/time_ms", "eval/time_ms/max_rank"):
            try:
                monitor.record(name, 1.0)
                out["record"][name] = None
            except ValueError as err:
                out["record"][name] = str(err)
        monitor.record("data/own", 2.0 + rank)  # a name of the user's own passes
        out["own"] = monitor.step(1, loss=1.0)["data/own"]
        out["eval"] = monitor.log_eval(1, loss=1.0 + rank, tokens=10 * (rank + 1), time_ms=100.0 + 200 * rank)
    samples = [("memory/own", 5.0, "max"), ("energy/own", 5.0, "max")]
    with dm.Monitor(quiet_config(log_interval=1, **off), collectors=[_Named(rank, samples, on=(1,))]) as monitor:
        try:
            monitor.step(1, loss=1.0)
            out["sample"] = None
        except ValueError as err:
            out["sample"] = str(err)
        out["written"] = dict(monitor.last_metrics)
    try:
        dm.Monitor(quiet_config(**off), collectors=[_Named(rank, writes=("gpu/",))]).close()
        out["writes"] = None
    except ValueError as err:
        out["writes"] = str(err)
    return out


def test_a_built_in_prefix_is_its_collectors_whole_with_its_switch_off():
    """With log_memory (and log_energy, log_gpu_telemetry, tensor inspection, log_throughput) off,
    monitor.record("memory/foo") and a collector's Sample("memory/own") were accepted and written, so turning
    the switch on later broke a script that ran (and a user's energy/total_j sat under the built-in's name).
    Refused as with the switch on: at the call, at the log step on every rank (rank 1 alone hands the samples
    over), and at Monitor(). log_eval's eval/time_ms is refused at the call too: accepted there, it made the
    next log_eval(time_ms=...) raise, and its record (eval/loss included) went unwritten."""
    results = run_ranks(_names_under_switched_off_collectors, 2)
    for rank, result in enumerate(results):
        for name, owner in SWITCHED_OFF.items():
            assert result["record"][name] == (f"monitor.record (mean) would write {name!r}, which the {owner!r} "
                                              "collector writes already"), (rank, name)
        for name in ("eval/time_ms", "eval/time_ms/max_rank"):
            assert result["record"][name] == (f"monitor.record (mean) would write {name!r}, which "
                                              "monitor.log_eval(time_ms=...) writes already"), (rank, name)
        assert result["own"] == 2.5  # the mean of the two ranks' 2.0 and 3.0
        # loss weighted by tokens: (1.0 * 10 + 2.0 * 20) / 30; time the slowest rank's, rank 1's 300 ms
        assert result["eval"]["eval/loss"] == pytest.approx(50.0 / 30.0) and result["eval"]["eval/time_ms"] == 300.0
        assert result["eval"]["eval/time_ms/max_rank"] == 1, result["eval"]
        assert result["written"]["mine/ok"] == 1.5 and not any(
            k.startswith(("memory/", "energy/")) for k in result["written"]), result["written"]
        assert "the 'mine' collector writes 'gpu/', which the 'gpu_telemetry' collector writes too" in \
            result["writes"], result["writes"]
    assert results[1]["sample"].startswith(
        "the 'mine' collector handed over a sample 'memory/own', which the 'memory' collector writes; the 'mine' "
        "collector handed over a sample 'energy/own', which the 'energy' collector writes"), results[1]["sample"]
    assert results[0]["sample"].startswith("rank 1's collectors handed over a sample named as a name another "
                                           "writer writes"), results[0]["sample"]


def test_writes_that_are_not_a_tuple_of_names_are_refused():
    """writes = ("data/") is the string "data/": five one-letter names, each a prefix of nothing."""
    import distmetrics as dm

    with pytest.raises(ValueError, match=r"the 'mine' collector's writes='data/' is not a tuple of metric names"):
        dm.Monitor(quiet_config(), collectors=[_Named(0, writes="data/")])
    dm.Monitor(quiet_config(), collectors=[_Named(0, writes={"data/"})]).close()  # a set of names is one
    # after = ("memory") is the string "memory": refused, not read as six collectors that are not there
    with pytest.raises(ValueError, match=r"the 'mine' collector's after='memory' is not a tuple of collector names"):
        dm.Monitor(quiet_config(), collectors=[_Named(0, after="memory")])


class _ReturnsNone(_Named):
    def finalize(self, metrics, ctx):  # no return: None, read as no alert
        metrics["mine/derived"] = 2.0


class _Overwrites(_Named):
    """A collector of the user's whose finalize writes over other writers' names (and one of its own)."""

    writes = ("data/",)

    def finalize(self, metrics, ctx):
        metrics["train/loss"] = -1.0  # monitor.step's
        metrics["memory/host_rss_gib"] = -1.0  # the memory collector's
        del metrics["train/lr"]
        metrics["data/derived"] = 3.0  # its own
        return []


def test_a_finalize_writing_over_another_writers_names_is_refused_and_the_record_keeps_them(tmp_path):
    """The ownership of names was checked for samples only: a finalize that set train/loss or another
    collector's memory/host_rss_gib wrote its value into the record, without a word."""
    import distmetrics as dm

    config = quiet_config(output_dir=str(tmp_path), log_interval=1, json_log=True, log_memory=True)
    with dm.Monitor(config, collectors=[_Overwrites(0, writes=("data/",))]) as monitor:
        with pytest.raises(ValueError) as raised:
            monitor.step(1, loss=2.5, lr=0.1)
    message = str(raised.value)
    assert message.startswith("the 'mine' collector's finalize wrote ") and "'train/loss', which " in message, message
    assert "'memory/host_rss_gib', which the 'memory' collector writes" in message and "'train/lr'" in message
    (record,) = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert record["train/loss"] == 2.5 and record["train/lr"] == 0.1 and record["memory/host_rss_gib"] > 0
    assert record["data/derived"] == 3.0


def test_a_finalize_that_returns_nothing_adds_no_alert():
    """A finalize without a return raised TypeError: 'NoneType' object is not iterable, naming nothing."""
    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=1), collectors=[_ReturnsNone(0)]) as monitor:
        assert monitor.step(1, loss=1.0)["mine/derived"] == 2.0


def test_wandb_keeps_a_record_of_a_lower_step_than_the_last(tmp_path):
    """A loop counting from 0 evaluates checkpoint s + 1 after step s; close() then writes the last
    interval at step 39, after the evaluation at 40. W&B's own step must grow, and it dropped that
    row (only W&B's console said so). Each row carries its step; the train rows read back are the
    JSONL's."""
    pytest.importorskip("wandb")
    import distmetrics as dm
    from tests.wandb_reader import read_offline_run

    cfg = quiet_config(output_dir=str(tmp_path), log_interval=10, json_log=True, wandb_project="p",
                       wandb_mode="offline")
    with dm.Monitor(cfg) as monitor:
        for step in range(40):
            monitor.step(step, loss=float(step), tokens=100)
            if (step + 1) % 20 == 0:
                monitor.log_eval(step + 1, loss=1.5, tokens=10)
    jsonl = [(r["step"], r["train/loss"]) for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert jsonl[-1][0] == 39
    rows = read_offline_run(str(tmp_path))["history"]
    assert [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r] == jsonl
    assert [r["step"] for r in rows if "eval/loss" in r] == [20, 40]


def test_loss_scale_is_a_users_name_where_no_fp16_megatron_optimizer_writes_it(tmp_path):
    """A torch.amp loop records its GradScaler's scale as loss_scale: refused once the name was
    reserved for the Megatron fp16 optimizer's, with none attached."""
    import torch

    import distmetrics as dm

    with dm.Monitor(quiet_config(output_dir=str(tmp_path), log_interval=1), model=torch.nn.Linear(2, 2)) as monitor:
        monitor.record("loss_scale", 65536.0)
        assert monitor.step(1, loss=1.0)["loss_scale"] == 65536.0


def test_an_all_metric_that_cannot_be_binned_skips_its_histogram_not_the_wandb_sink(tmp_path, caplog):
    """A NaN in an ``all`` metric (numpy cannot bin it) or a value near 1e17 (too many bins) raised
    in wandb.Histogram, and the W&B sink was off for the rest of the run. The histogram holds the
    finite values; W&B skips one it cannot bin, with one warning; the summary shows the NaN (it
    was left out of it, so the dashboards saw none)."""
    pytest.importorskip("wandb")
    import logging

    import distmetrics as dm
    from tests.wandb_reader import read_offline_run

    caplog.set_level(logging.WARNING, logger="distmetrics")
    cfg = quiet_config(output_dir=str(tmp_path), log_interval=2, json_log=True, wandb_project="p",
                       wandb_mode="offline")
    values = {1: 1.0, 2: 2.0, 3: math.nan, 4: math.nan, 5: 1e17, 6: 1e17, 7: 3.0, 8: 3.0}
    with dm.Monitor(cfg) as monitor:
        for step, value in values.items():
            monitor.record("probe", value, reduce="all")
            monitor.step(step, loss=1.0)
        failed = dict(monitor.sinks.failed)
    assert failed == {}
    rows = {r["step"]: r for r in read_offline_run(str(tmp_path))["history"] if "train/loss" in r}
    assert sorted(rows) == [2, 4, 6, 8]
    assert math.isnan(rows[4]["probe/max"]) and math.isnan(rows[4]["probe/mean"])
    assert rows[6]["probe/max"] == 1e17 and rows[8]["probe/max"] == 3.0
    histograms = [step for step, row in sorted(rows.items()) if "probe/values" in row]  # W&B's nested histogram
    assert histograms == [2, 8]
    skipped = [r.getMessage() for r in caplog.records if "skipped the histogram probe" in r.getMessage()]
    assert len(skipped) == 1 and "at step 6" in skipped[0]
    train = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert math.isnan(train[1]["probe/rank0"]) and math.isnan(train[1]["probe/max"])


def _dtensor_loss(rank: int, world: int, device_path: bool) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    import distmetrics as dm
    import distmetrics.packing as packing
    import distmetrics.packs as packs

    if device_path:  # a loss on a GPU is packed by tensor operations: host_number says "not on the host" there,
        on_host = packing.host_number  # and the health count stays on the device
        packing.host_number = packs.host_number = lambda v: None if isinstance(v, DTensor) else on_host(v)
        from distmetrics.collectors import health
        health._nonfinite = lambda value: (~torch.isfinite(value.detach())).to(torch.float64).sum()  # its device branch
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    logits = distribute_tensor(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), mesh, [Shard(1)])
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor([1, 5, 0, 7]))
    out = {"truth": float(loss.full_tensor())}
    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        out["train/loss"] = monitor.step(1, loss=loss.detach(), tokens=4)["train/loss"]
        try:
            monitor.step(2, loss=DTensor.from_local(torch.tensor(1.0), mesh, [Partial()]))
        except ValueError as err:
            out["partial"] = str(err)
        monitor.step(2, loss=loss.detach())
    return out


@pytest.mark.parametrize("device_path", [False, True], ids=["host packs", "device packs (simulated)"])
def test_a_replicate_dtensor_loss_is_the_loss_and_a_partial_one_is_refused(device_path):
    """loss_parallel's loss is a Replicate DTensor: on a GPU its packing mixed DTensor and
    tensors in one torch.cat and every log step raised. The device path is simulated on CPU by
    having host_number decline the DTensor, as it declines any value not on the host (the one
    stand-in: no GPU here). A Partial DTensor's piece is not the value: refused at the call."""
    for out in run_ranks(_dtensor_loss, 2, device_path, timeout=120):
        assert out["train/loss"] == pytest.approx(out["truth"], rel=1e-6)
        assert "a DTensor with placements (Partial(sum),)" in out["partial"]


def _vector_samples_of_dtensors_and_complex_values(rank: int, world: int, root: str) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    import distmetrics as dm

    mesh = init_device_mesh("cpu", (world,))

    class PerLayer:
        name, after, writes = "per_layer", (), ("layer/",)
        complex = False

        def take_samples(self, ctx):
            if self.complex:
                return [dm.Sample("layer/c", torch.tensor([3 + 4j, -1j]), "sum", names=("layer/c0", "layer/c1"))]
            # each rank's own copy (from_local, not distribute_tensor, which sends rank 0's to every rank)
            value = DTensor.from_local(torch.tensor([1.0, 2.0, 3.0]) * (rank + 1), mesh, [Replicate()])
            weight = DTensor.from_local(torch.tensor([1.0, 1.0, 2.0]), mesh, [Replicate()])
            return [dm.Sample("layer/x", value, "max", names=("layer/0", "layer/1", "layer/2")),
                    dm.Sample("layer/m", value, "mean", weight=weight, names=("layer/m0", "layer/m1", "layer/m2"))]

        def finalize(self, metrics, ctx):
            return []

        def close(self):
            pass

    collector = PerLayer()
    out = {}
    with dm.Monitor(quiet_config(log_interval=1, json_log=True, output_dir=root), collectors=[collector]) as monitor:
        got = monitor.step(1, loss=1.0)
        out["x"] = [got[f"layer/{i}"] for i in range(3)] + [got[f"layer/m{i}"] for i in range(3)]
        collector.complex = True
        try:
            monitor.step(2, loss=1.0)
        except Exception as err:  # noqa: BLE001 - what each rank raised
            out["complex"] = f"{type(err).__name__}: {err}"
    return out


def test_a_vector_sample_of_replicate_dtensors_is_each_ranks_copy_and_a_complex_one_is_refused(tmp_path):
    """A Replicate DTensor as a vector sample's value or weight failed in the packs (`.tolist()` of
    a tensor subclass) at every log step, and no train record was written; a complex vector was
    written as its real parts. Truth: rank r's copy is [1, 2, 3]·(r+1): the max over 2 ranks
    [2, 4, 6], the mean [1.5, 3, 4.5]."""
    for out in run_ranks(_vector_samples_of_dtensors_and_complex_values, 2, str(tmp_path), timeout=120):
        assert out["x"] == [2.0, 4.0, 6.0, 1.5, 3.0, 4.5]
        assert "Sample 'layer/c' value: expected real numbers, got a tensor of torch.complex64" in out["complex"], out


def test_a_second_collectors_finalize_error_is_said_and_the_first_raised_after_the_record(tmp_path, caplog):
    """The first error comes out of monitor.step once the record is written; a later collector's
    error in the same log step was dropped without a word."""
    import logging

    import distmetrics as dm

    class Raises:
        after, writes = (), ()

        def __init__(self, name):
            self.name = name

        def take_samples(self, ctx):
            return []

        def finalize(self, metrics, ctx):
            raise RuntimeError(f"{self.name} failed")

        def close(self):
            pass

    caplog.set_level(logging.WARNING, logger="distmetrics")
    cfg = quiet_config(log_interval=1, json_log=True, output_dir=str(tmp_path))
    with dm.Monitor(cfg, collectors=[Raises("first"), Raises("second")]) as monitor:
        with pytest.raises(RuntimeError, match="first failed"):
            monitor.step(1, loss=2.0)
    assert [(r["step"], r["train/loss"]) for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"] \
        == [(1, 2.0)]
    assert "the second collector's finalize also failed at step 1: RuntimeError: second failed" in caplog.text


def test_eval_gap_is_left_out_where_train_records_weighted_their_losses_differently(caplog):
    """Each train record weighs its loss alike (tokens, or steps with tokens=None), but eval/gap averaged
    one record's mean over 200 tokens with another's over 2 steps: the token record all but decided it."""
    import logging

    import distmetrics as dm

    caplog.set_level(logging.WARNING, logger="distmetrics")
    with dm.Monitor(quiet_config(log_interval=2)) as monitor:
        for step in (1, 2):
            monitor.step(step, loss=1.0, tokens=100)
        for step in (3, 4):
            monitor.step(step, loss=3.0)
        mixed = monitor.log_eval(4, loss=2.5)
        for step in (5, 6):
            monitor.step(step, loss=3.0)
        alike = monitor.log_eval(6, loss=2.5)
    assert "eval/gap" not in mixed and mixed["eval/loss"] == 2.5
    assert alike["eval/gap"] == pytest.approx(-0.5)  # the records since the last evaluation: steps alone
    said = [r.getMessage() for r in caplog.records if "eval/gap is left out" in r.getMessage()]
    assert len(said) == 1 and "step 4" in said[0], said


def test_a_job_that_never_evaluates_keeps_no_train_loss_per_log_step():
    """The train losses an eval/gap needs were kept as a tuple per log step until the next
    log_eval: a job that never evaluates grew by about 150 bytes a log step on every rank."""
    import tracemalloc

    import distmetrics as dm
    from tests.dist_utils import quiet_config

    monitor = dm.Monitor(quiet_config(log_interval=1))
    for step in range(1, 51):
        monitor.step(step, loss=float(step), tokens=10)
    tracemalloc.start()
    try:
        for step in range(51, 1051):
            monitor.step(step, loss=float(step), tokens=10)
        kept = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*distmetrics/evaluation.py")])
    finally:
        tracemalloc.stop()
    assert sum(stat.size for stat in kept.statistics("filename")) < 4096
    gap = monitor.log_eval(1051, loss=1000.0, tokens=10)["eval/gap"]
    assert gap == pytest.approx(1000.0 - 525.5)  # the mean of steps 1-1050
    monitor.close()


def test_a_log_step_keeps_the_slots_of_the_names_in_use_not_of_every_name_ever_recorded():
    """Names used once (a step number in the name) each kept a slot that every later log step walked
    and rebuilt: beside 100 fixed names, 500 new ones per log step made the log step 30 times slower
    in 200 of them. A log step keeps the slots of the names of its interval (the next one reuses
    them) and drops those of the names it did not see; its samples are its interval's names, as
    before, and a name that comes back keeps its reduce kind."""
    from distmetrics.interval import IntervalStats

    stats = IntervalStats()
    fixed = [f"fixed/{i}" for i in range(10)]
    for log_step in range(20):
        for name in fixed:
            stats.record(name, float(log_step))
            stats.record(name, float(log_step) + 2.0)
        once = [f"once/{log_step}/{i}" for i in range(50)]
        for name in once:
            stats.record(name, 2.0, reduce="sum")
        samples = stats.take_samples()
        assert [(s.name, s.value / s.weight if s.reduce == "mean" else s.value) for s in samples] == \
            [(name, log_step + 1.0) for name in fixed] + [(name, 2.0) for name in once]
        assert list(stats._slots) == fixed + once  # 60, not 10 + 50 per log step so far
    with pytest.raises(ValueError, match="metric 'once/0/0' was recorded with reduce='sum', now reduce='mean'"):
        stats.record("once/0/0", 1.0)


def test_a_list_of_model_chunks_is_refused_naming_them(tmp_path):
    """Megatron's virtual pipeline hands a list of model chunks: it was refused as "model must be a
    torch.nn.Module or a callable that builds one, got list", which did not say why or what works."""
    import torch

    import distmetrics as dm

    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    with pytest.raises(TypeError, match=r"a list of 2 modules \(Megatron's model chunks.*ModuleList\(chunks\)"):
        dm.Monitor(quiet_config(output_dir=str(tmp_path)), model=chunks)
    # get_model()'s list of one chunk (no virtual pipeline): ModuleList would prefix every name with "0."
    with pytest.raises(TypeError, match=r"a list of one module .* give the module, model\[0\]$"):
        dm.Monitor(quiet_config(output_dir=str(tmp_path)), model=chunks[:1])


def _records_from_threads(rank: int, world: int) -> dict:
    """monitor.record from 4 threads at once, then from a thread that records while the main thread
    makes log steps (log_interval 1). Tensor values: torch releases the GIL inside their adds."""
    import threading

    import torch

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=1, log_throughput=False))
    one, two = torch.tensor(1.0), torch.tensor(2.0)
    start = threading.Barrier(4)

    def many():
        start.wait()
        for _ in range(5000):
            monitor.record("u/sum", one, reduce="sum")
            monitor.record("u/mean", two)

    threads = [threading.Thread(target=many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = monitor.step(1)
    made, stop = [0], threading.Event()

    def steady():
        while not stop.is_set():
            monitor.record("u/steady", one, reduce="sum")
            made[0] += 1

    thread = threading.Thread(target=steady)
    thread.start()
    written = []
    for step in range(2, 200):
        written.append((monitor.step(step) or {}).get("u/steady", 0.0))
    stop.set()
    thread.join()
    written.append((monitor.step(200) or {}).get("u/steady", 0.0))
    monitor.close()
    return {"sum": first["u/sum"], "mean": first["u/mean"], "made": made[0], "written": sum(written)}


def test_records_from_several_threads_are_each_counted_once():
    """record may come from any thread (an autograd hook's, a data thread's). From 4 threads at once
    a sum lost 10-15% of its records and a mean of 2.0 read 1.4; a record made while a log step took
    the interval was counted in two records (a mean of 2.0 read 7.1). Truth: the counts made."""
    out = run_ranks(_records_from_threads, 2, timeout=240)
    total_made = sum(o["made"] for o in out)
    for o in out:
        assert o["sum"] == 2 * 4 * 5000 and o["mean"] == 2.0, o
        assert o["written"] == total_made, (o["written"], total_made)


def test_a_value_recorded_after_the_last_step_is_said_at_close(tmp_path, caplog):
    """A value recorded after the last monitor.step (a background thread's last one, a final
    accuracy) was dropped by close() without a word: it belongs to a step that never came."""
    import torch

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=5, output_dir=str(tmp_path), json_log=True))
    for step in range(1, 11):
        monitor.step(step, loss=1.0)
    monitor.record("final/accuracy", 0.9)
    monitor.record_losses(torch.tensor([1.0]), ["web"])
    with caplog.at_level("WARNING", logger="distmetrics"):
        monitor.close()
    said = [r.getMessage() for r in caplog.records if "recorded after the last monitor.step" in r.getMessage()]
    assert len(said) == 1 and "'final/accuracy'" in said[0] and "step 10" in said[0], caplog.text
    assert "record_losses" in said[0]
    records = list(dm.read_jsonl(tmp_path / "metrics.jsonl"))
    assert not any("final/accuracy" in r for r in records)


def test_a_name_first_recorded_while_the_interval_is_taken_goes_to_the_next_interval(monkeypatch):
    """A record from a signal handler runs on the thread that holds the record lock (it is
    re-entrant): a new name recorded while a log step took the interval raised "dictionary changed
    size during iteration" and lost every record of that log step."""
    import distmetrics.interval as interval

    stats = interval.IntervalStats()
    stats.record("a", 1.0)
    stats.record("b", 2.0, reduce="sum")
    made = interval.Sample

    def sample_and_record(*args, **kwargs):  # as a handler landing inside the loop would
        if "late" not in stats._slots:
            stats.record("late", 5.0, reduce="sum")
        return made(*args, **kwargs)

    monkeypatch.setattr(interval, "Sample", sample_and_record)
    first = {s.name: s.value for s in stats.take_samples()}
    monkeypatch.setattr(interval, "Sample", made)
    assert first == {"a": 1.0, "b": 2.0}
    assert {s.name: s.value for s in stats.take_samples()} == {"late": 5.0}


def _pipeline_stages_on_a_mesh(rank: int, world: int, style: str) -> dict:
    """A pp × dp = 2 × 2 mesh, each stage's layer under FSDP2 over its dp ranks, the Monitor given the
    model and no device_mesh; the pipeline rank holding the last stage (the last, or the first under
    ``pipeline_style="v"``) passes the loss, the other torchtitan's placeholder of -1."""
    import logging

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distmetrics as dm

    said: list = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=mesh["dp"])
    with dm.Monitor(quiet_config(log_interval=1, log_throughput=True, pipeline_style=style), model=model) as monitor:
        loss = 2.0 + rank % 2 + 2 if stage == (0 if style == "v" else 1) else -1.0
        for step in (1, 2):
            metrics = monitor.step(step, loss=loss, tokens=10)
        evaluated = monitor.log_eval(2, loss=loss, tokens=10)
    logging.getLogger("distmetrics").removeHandler(handler)
    return {"pp": (monitor.layout.pp_rank, monitor.layout.pp_size), "tokens": metrics["train/consumed_tokens"],
            "loss": metrics["train/loss"], "eval": evaluated["eval/loss"],
            "said": [line for line in said if "on pipeline rank" in line]}


@pytest.mark.parametrize("style", ["loop", "v"])
def test_pipeline_stages_of_a_models_mesh_count_tokens_and_the_loss_once(style):
    """Without device_mesh, a model's ("pp", "dp") mesh was dropped (only tp/cp dimensions were read): each
    stage counted its batch's tokens (consumed tokens, tokens/s and MFU doubled), and torchtitan's
    placeholder loss of -1 on the first stage was averaged into train/loss and eval/loss (1.5 for 4.5).
    Under pipeline_style="v" (ZBV, DualPipeV) the last stage is on pipeline rank 0: its loss was left out
    there, and train/loss with it."""
    results = run_ranks(_pipeline_stages_on_a_mesh, 4, style, timeout=120)
    for rank, out in enumerate(results):
        assert out["pp"] == (rank // 2, 2), (rank, out)
        assert out["tokens"] == 40.0, (rank, out)  # 2 steps × 2 dp ranks × 10, once for the pipeline
        assert out["loss"] == 4.5 and out["eval"] == 4.5, (rank, out)  # the loss holder's dp ranks: 4.0 and 5.0
    says, holder = (2, 0) if style == "v" else (0, 1)  # the first rank of the first pipeline rank without the loss
    where = ("pipeline_style='v' puts on pipeline rank 0 ('loop': on the last)" if style == "v" else
             "pipeline_style='loop' puts on pipeline rank 1 ('v': on rank 0, as ZBV and DualPipeV schedules do)")
    assert results[says]["said"] == [
        f"distmetrics: monitor.{call}(loss=...) on pipeline rank {1 - holder} of 2 is left out: the loss is the last "
        f"stage's, which {where}; a placeholder, as torchtitan passes on the other stages, would be averaged in: "
        "pass loss=None there. Said once" for call in ("step", "log_eval")], results[says]["said"]
    assert all(out["said"] == [] for rank, out in enumerate(results) if rank != says)


def _tokens_on_the_first_stage_only(rank: int, world: int) -> dict:
    """pp × dp = 2 × 2, each stage's layer under FSDP2 over its dp ranks: the first stage (where a data
    loader is) passes tokens, the last the loss alone."""
    import logging

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distmetrics as dm

    said: list = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    last = mesh.get_coordinate()[0] == 1
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=mesh["dp"])
    records = []
    with dm.Monitor(quiet_config(log_interval=1, log_throughput=True), model=model) as monitor:
        for step in (1, 2, 3):
            records.append(monitor.step(step, loss=1.0 if last else None, tokens=None if last else 100))
    logging.getLogger("distmetrics").removeHandler(handler)
    return {"names": sorted({k for r in records for k in r}), "said": [s for s in said if "tokens=" in s]}


def test_tokens_given_only_where_they_do_not_count_are_said():
    """Tokens passed on the first pipeline stage alone (where the batch is loaded), none on the last, where
    they count: the records had no throughput and checkpoints counted 0 tokens, unsaid. Said once now, by
    the first rank; and no internal lane reaches the records."""
    results = run_ranks(_tokens_on_the_first_stage_only, 4, timeout=120)
    for out in results:
        assert "train/consumed_tokens" not in out["names"] and "train/loss" in out["names"], out
        assert not [name for name in out["names"] if name.startswith("_")], out
    assert len(results[0]["said"]) == 1 and results[0]["said"][0].startswith(
        "distmetrics: step 1: monitor.step(tokens=...) was given only on ranks that do not count tokens"), results[0]
    assert all(out["said"] == [] for out in results[1:])


def _v_shaped_schedule(rank: int, world: int, schedule_name: str, out: str) -> dict:
    """torch.distributed.pipelining's V-shaped schedule over 2 pipeline ranks, 4 stages of one layer
    each: rank r holds stages r and 3 − r, so the last stage (the loss) is on rank 0. The Monitor is
    given ``ModuleList([stage r, stage 3 − r])`` and ``pipeline_style="v"``. Truth: the loss of the
    whole model in float64, and float64 of both ranks' gradients."""
    from collections import OrderedDict

    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    from torch.distributed.device_mesh import init_device_mesh

    import distmetrics as dm

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(2 * world)]
    held = (rank, 2 * world - 1 - rank)
    parts = [torch.nn.Sequential(OrderedDict([(f"layer{s}", layers[s])])) for s in held]
    stages = [pipelining.PipelineStage(part, s, 2 * world, torch.device("cpu"), group=mesh["pp"].get_group())
              for part, s in zip(parts, held)]
    schedule = getattr(pipelining, schedule_name)(stages, 4, loss_fn=lambda y, t: (y - t).pow(2).mean())
    x, target = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 8)
    truth_loss = torch.nn.functional.mse_loss(torch.nn.Sequential(*layers).double()(x.double()), target.double())
    layers = [layer.float() for layer in layers]
    config = quiet_config(output_dir=out, json_log=True, log_interval=1, pipeline_style="v", log_throughput=True)
    with dm.Monitor(config, model=torch.nn.ModuleList(parts), device_mesh=mesh) as monitor:
        losses: list = []
        schedule.step(x, target=target, losses=losses) if rank == 0 else schedule.step()
        squares = [None] * world
        dist.all_gather_object(squares, sum(float(p.grad.double().pow(2).sum()) for p in monitor.model.parameters()))
        monitor.clip_grad_norm_(1e9)
        metrics = monitor.step(1, loss=torch.stack(losses).mean().item() if losses else None, tokens=64)
    return {"loss": metrics["train/loss"], "truth_loss": float(truth_loss), "tokens": metrics["train/consumed_tokens"],
            "grad_norm": metrics["grad_norm"], "truth_norm": sum(squares) ** 0.5, "losses_here": len(losses)}


@pytest.mark.parametrize("schedule_name", ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"])
def test_v_shaped_pipeline_schedules_hold_the_loss_on_the_first_pipeline_rank(schedule_name, tmp_path):
    """ZBV and DualPipeV put the last stage on pipeline rank 0: with pipeline_style="v" its loss is the
    one counted (it was left out there, so the record had no train/loss), tokens count once, and the
    run record lists the modules in stage order (it took the looped order: stage 0, 1, 3, 2)."""
    results = run_ranks(_v_shaped_schedule, 2, schedule_name, str(tmp_path), timeout=120)
    assert [out["losses_here"] for out in results] == [4, 0]  # torch's schedule: the loss on rank 0 alone
    for out in results:
        assert out["loss"] == pytest.approx(out["truth_loss"], rel=1e-5), out
        assert out["grad_norm"] == pytest.approx(out["truth_norm"], rel=1e-5), out
        assert out["tokens"] == 64.0, out
    run = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert run["kind"] == "run"
    assert [name for name in run["modules"] if "layer" in name] == ["0.layer0", "0.layer1", "1.layer2", "1.layer3"]


CP_MASKS = {  # (dp rank, step) -> the valid tokens of that replica's 8-token sequence; cp rank c holds [4c, 4c + 4)
    (0, 1): "11101000", (1, 1): "11111110",
    (0, 2): "10000111", (1, 2): "11010000",  # dp 1's cp rank 1 holds no valid token: a loss over nothing, NaN
    (0, 3): "11111000", (1, 3): "01000011"}  # step 3: the evaluation's batch


def cp_token_losses(dp: int, step: int) -> list:
    """Every valid token's loss in replica ``dp``'s sequence at ``step``, by position."""
    return [(i, 0.5 + 0.25 * i + dp + 0.1 * step) for i, bit in enumerate(CP_MASKS[dp, step]) if bit == "1"]


def _context_parallel_losses(rank: int, world: int) -> dict:
    """dp × cp = 2 × 2 ("dp", "cp"): each cp rank's loss is the mean over its slice's valid tokens, passed with
    ``tokens`` the whole sequence's valid tokens (counted for throughput) and ``loss_tokens`` its slice's."""
    import math

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import distmetrics as dm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp, cp = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")

    def batch(step):
        mine = [loss for i, loss in cp_token_losses(dp, step) if 4 * cp <= i < 4 * cp + 4]
        return (sum(mine) / len(mine) if mine else math.nan), len(mine), len(cp_token_losses(dp, step))

    out: dict = {}
    with dm.Monitor(quiet_config(log_interval=2, log_throughput=True), device_mesh=mesh) as monitor:
        for step in (1, 2):
            loss, mine, whole = batch(step)
            if step == 2:  # tensors at this step, numbers at the first
                loss, mine = torch.tensor(loss, dtype=torch.float64), torch.tensor(mine)
            out["train"] = monitor.step(step, loss=loss, tokens=whole, loss_tokens=mine)
        loss, mine, whole = batch(3)
        out["eval"] = monitor.log_eval(3, loss=loss, tokens=whole, loss_tokens=mine)
        refused = []
        for call in (lambda: monitor.step(3, loss=1.0, tokens=8, loss_tokens=-1),
                     lambda: monitor.log_eval(3, loss=1.0, tokens=8, loss_tokens=math.nan)):
            try:
                call()
            except ValueError as err:
                refused.append(str(err))
        out["refused"] = refused
        bad = torch.tensor(math.nan if rank == 3 else 2.0)  # not read at the call: seen in the sum at the log step
        try:
            for step in (3, 4):
                monitor.step(step, loss=1.0, tokens=8, loss_tokens=bad)
        except ValueError as err:
            out["tensor refused"] = (str(err), "train/loss" in monitor.last_metrics)
    return out


@pytest.fixture(scope="module")
def context_parallel():
    return run_ranks(_context_parallel_losses, 4, timeout=120)


def _cp_truth(steps) -> float:
    """Float64 mean over every valid token of every replica in ``steps``."""
    losses = [loss for dp in (0, 1) for step in steps for _, loss in cp_token_losses(dp, step)]
    return math.fsum(losses) / len(losses)


def test_context_parallel_loss_is_weighted_by_loss_tokens_and_tokens_count_once(context_parallel):
    """Under context parallelism tokens= is the whole sequences' (counted once, for throughput) while each cp
    rank's loss is a mean over its own slice: weighted by tokens, a slice of 1 valid token weighs as much as its
    peer's of 4 (eval/loss 1.956 for 1.925). loss_tokens= weighs each rank's loss by its slice's valid tokens;
    an all-masked slice (loss NaN, loss_tokens 0) counts for nothing and is no non-finite loss."""
    consumed = sum(len(cp_token_losses(dp, step)) for dp in (0, 1) for step in (1, 2))
    for rank, out in enumerate(context_parallel):
        assert out["eval"]["eval/loss"] == pytest.approx(_cp_truth((3,)), rel=1e-12), (rank, out["eval"])
        assert out["train"]["train/loss"] == pytest.approx(_cp_truth((1, 2)), rel=1e-12), (rank, out["train"])
        assert out["train"]["train/consumed_tokens"] == consumed == 18, (rank, out["train"])  # 36: once per cp rank
        assert out["train"]["health/nonfinite_loss"] == 0, (rank, out["train"])
        assert "train/loss_tokens" not in out["train"] and "eval/loss_tokens" not in out["eval"]


def test_a_bad_loss_tokens_is_refused_naming_it(context_parallel):
    """A number is refused at the call, before any collective (no rank waits); a tensor, not read at the call,
    in its sum over ranks at the log step: the record is written without train/loss, then raised on every rank."""
    for out in context_parallel:
        assert [message.split(":")[0] for message in out["refused"]] == [
            "monitor.step(loss_tokens=...)", "monitor.log_eval(loss_tokens=...)"], out["refused"]
        assert all("accepted values are finite numbers >= 0" in message for message in out["refused"])
        message, has_loss = out["tensor refused"]
        assert message.startswith("monitor.step(loss_tokens=...): the loss_tokens of the steps up to step 4") \
            and not has_loss, out["tensor refused"]


MEGATRON_LOSSES = {1: [(40.0, 10), (90.0, 30)], 2: [(300.0, 100), (10.0, 5)], 3: [(9.0, 3), (2.0, 1)],
                   4: [(5.0, 1), (8.0, 2)], 5: [(0.0, 0), (12.0, 4)]}
"""Per step, each data-parallel rank's (loss sum, loss tokens) over its micro-batches, as Megatron's ``loss_func``
gives them: step 4 skipped (its update failed), rank 0's every token masked at step 5."""


def _megatron_losses(rank: int, world: int, out: str) -> dict:
    """The README's Megatron-Core call, ``loss=loss_sum / loss_tokens, loss_tokens=loss_tokens`` (tensors, as the
    schedule's losses are), at ``log_interval`` 1 and 5 (each ``loss_average``), and at 1 given ``tokens`` alone;
    then ``loss_average: steps`` over 3 steps and a ``close()`` after 2 more."""
    import torch

    import distmetrics as dm

    written = {}
    for name, interval, counted, average in (
            ("each", 1, True, "tokens"), ("interval", 5, True, "tokens"), ("tokens", 1, False, "tokens"),
            ("steps", 5, True, "steps"), ("last", 5, True, "last"), ("closed", 3, True, "steps")):
        config = quiet_config(log_interval=interval, output_dir=f"{out}/{name}", json_log=True, log_throughput=True,
                              loss_average=average)
        with dm.Monitor(config) as monitor:
            for step, per_rank in MEGATRON_LOSSES.items():
                loss_sum, loss_tokens = torch.tensor(per_rank[rank], dtype=torch.float32)
                monitor.step(step, loss=loss_sum / loss_tokens, tokens=256, skipped=step == 4,
                             **({"loss_tokens": loss_tokens} if counted else {}))
            if name == "steps":
                monitor.log_eval(5, loss=3.0, tokens=256)
        written[name] = [json.loads(line) for line in open(f"{out}/{name}/metrics.jsonl")
                         if '"kind":"train"' in line or '"kind":"eval"' in line]
    return written


def test_the_megatron_call_gives_each_iterations_lm_loss_and_loss_average_megatrons_or_torchtitans(tmp_path):
    """Megatron-LM's ``train_step`` reduces an iteration's loss as the loss sums over micro-batches and
    data-parallel ranks over their loss tokens; ``training_log`` prints the plain mean of the interval's
    non-skipped iterations' losses (its formulas, computed here in float64). Given ``loss_tokens`` the
    README's call writes each iteration's at ``log_interval: 1`` (a replica with every token masked counts
    for nothing); over 5 steps ``train/loss`` pools the loss tokens instead (1.3 % apart here, as the README
    says); given ``tokens`` alone, the masked replica's NaN is the step's loss. ``loss_average: steps`` gives
    Megatron's interval mean, ``last`` the log step's own loss (torchtitan's); ``eval/gap`` stays over the
    token-weighted training loss."""
    records = run_ranks(_megatron_losses, 2, str(tmp_path), timeout=120)[0]
    each = {step: math.fsum(s for s, _ in ranks) / math.fsum(n for _, n in ranks)
            for step, ranks in MEGATRON_LOSSES.items()}
    advanced = [step for step in MEGATRON_LOSSES if step != 4]
    megatron_interval = math.fsum(each[step] for step in advanced) / len(advanced)
    pooled = math.fsum(s for step in advanced for s, _ in MEGATRON_LOSSES[step]) / math.fsum(
        n for step in advanced for _, n in MEGATRON_LOSSES[step])
    by_step = {record["step"]: record for record in records["each"]}
    for step in advanced:
        assert by_step[step]["train/loss"] == pytest.approx(each[step], rel=1e-6), (step, by_step[step])
    assert "train/loss" not in by_step[4]  # skipped: no loss, as Megatron leaves it out
    [interval] = records["interval"]
    assert interval["train/loss"] == pytest.approx(pooled, rel=1e-6), interval
    assert abs(interval["train/loss"] / megatron_interval - 1) == pytest.approx(0.0127, abs=5e-4)
    by_step = {record["step"]: record for record in records["tokens"]}
    assert math.isnan(float(by_step[5]["train/loss"])) and by_step[1]["train/loss"] != pytest.approx(each[1], rel=1e-3)
    # loss_average: steps is Megatron's lm loss; last, the log step's own, torchtitan's
    train, evaluation = records.pop("steps")
    assert train["train/loss"] == pytest.approx(megatron_interval, rel=1e-6), train
    assert evaluation["eval/gap"] == pytest.approx(3.0 - pooled, rel=1e-6), evaluation  # the token-weighted one
    assert [r["train/loss"] for r in records["last"]] == [pytest.approx(each[5], rel=1e-6)]
    first, closed = records["closed"]  # steps 1-3 and close()'s 4-5 (4 skipped)
    assert first["train/loss"] == pytest.approx(math.fsum(each[step] for step in (1, 2, 3)) / 3, rel=1e-6)
    assert closed["step"] == 5 and closed["train/loss"] == pytest.approx(each[5], rel=1e-6)
    assert not [k for r in (train, *records["closed"]) for k in r if k.startswith("_")]


def _a_rank_without_losses(rank: int, world: int) -> list:
    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=3, loss_average="steps")) as monitor:
        # step 5's every loss token masked (the only loss, rank 0's, weighs 0): no step of the mean
        return [monitor.step(step, loss=float(step * step) if rank == 0 else None, tokens=0 if step == 5 else step)
                for step in range(1, 7)]


def test_loss_average_is_the_same_on_a_rank_that_gave_no_loss():
    """A rank with no loss in the interval (a stage without it) sent no step losses: it read no step names and
    returned the token-weighted loss, with the others' internal lanes in its dict, where rank 0 returned the mean.
    A step whose losses all weigh 0 is left out of the mean (Megatron's would be NaN)."""
    first, second = run_ranks(_a_rank_without_losses, 2, timeout=120)
    assert first == second and first[2]["train/loss"] == pytest.approx(14 / 3), (first, second)
    assert first[5]["train/loss"] == pytest.approx((16 + 36) / 2), first[5]  # step 5 left out
    assert not [k for record in first if record for k in record if k.startswith("_")]


@pytest.mark.parametrize("average", ["steps", "last"])
def test_loss_average_of_losses_whose_sum_passes_float64_is_their_mean(average, tmp_path):
    """Two steps' losses of 1e308 (no tokens: each weighs 1): their sum overflowed in fsum, so the log step raised
    and lost its record."""
    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=2, output_dir=str(tmp_path), json_log=True, loss_average=average)) as m:
        m.step(1, loss=1e308)
        assert m.step(2, loss=1e308)["train/loss"] == 1e308


GAP_LOSSES, GAP_TOKENS = {1: (2.0, 4.0), 2: (3.0, 1.0)}, {1: (10, 30), 2: (20, 5)}  # step: (rank 0's, rank 1's)


def _train_then_eval(rank: int, world: int) -> dict:
    import distmetrics as dm

    out = {}
    for average in ("tokens", "steps", "last"):
        with dm.Monitor(quiet_config(log_interval=2, loss_average=average)) as monitor:
            for step in (1, 2):
                written = monitor.step(step, loss=GAP_LOSSES[step][rank], tokens=GAP_TOKENS[step][rank])
            out[average] = written["train/loss"], monitor.log_eval(2, loss=1.5, tokens=10)["eval/gap"]
    return out


def test_eval_gap_takes_the_token_weighted_training_loss_whatever_loss_average_writes():
    """The README's eval/gap: eval/loss minus the token-weighted training loss of the intervals since the last
    evaluation, whatever loss_average writes as train/loss (float64 by hand over both ranks and steps)."""
    pooled = sum(GAP_LOSSES[s][r] * GAP_TOKENS[s][r] for s in (1, 2) for r in (0, 1)) / 65
    for out in run_ranks(_train_then_eval, 2, timeout=120):
        for average, (train, gap) in out.items():
            assert gap == pytest.approx(1.5 - pooled, rel=1e-12), average
            assert train == pytest.approx({"tokens": pooled, "steps": (140 / 40 + 65 / 25) / 2,
                                           "last": 65 / 25}[average]), average


@pytest.mark.parametrize("steps, said", [
    (range(1, 25, 2), "5 monitor.step calls by a stride of 2 from step 1 (to step 9)"), (range(2, 25, 2), None),
    (range(3, 37, 3), None), (range(7, 19), None), ([1, 2, 3, 5, 6, 7, 8, 12], None), ([1, 2, 3, 5, 8], None),
    ([1, 2, *range(6, 40, 4)], "5 monitor.step calls by a stride of 4 from step 2 (to step 18)"),
    ([1, 3, 5, *range(9, 40, 2)], "5 monitor.step calls by a stride of 2 from step 9 (to step 17)")])
def test_steps_numbered_so_that_no_log_step_comes_are_said_once(steps, said, tmp_path, caplog):
    """Odd steps with log_interval 4 never reach a multiple of 4: no record came until close(), unsaid. Steps
    a + k·s never reach one where a is no multiple of gcd(s, 4): said once, after 5 such calls; a step number
    left out (4: a call refused) or a stride that grows (steps counted in samples, ramping up) starts a new run
    from the step before, which may reach log steps (8, 12: nothing said) or not (2 + k·4, 9 + k·2)."""
    import distmetrics as dm

    with dm.Monitor(quiet_config(log_interval=4, output_dir=str(tmp_path), json_log=True)) as monitor:
        logged = [step for step in steps if monitor.step(step, loss=1.0)]
    warned = [r.getMessage() for r in caplog.records if "and no log step" in r.getMessage()]
    if said is None:
        assert logged and not warned, (logged, warned)
        return
    assert not logged and len(warned) == 1, (logged, warned)
    assert warned[0].startswith(f"distmetrics: {said} and no log step"), warned


def _stages_on_an_unflattened_mesh(rank: int, world: int) -> dict:
    """A pp × dp = 2 × 1 mesh unflattened from the 1-D world mesh (current torchtitan's way), each
    stage's layer under FSDP2 over its dp mesh (one rank), the Monitor given no device_mesh."""
    import logging

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distmetrics as dm

    said: list = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))._unflatten(0, (world, 1), ("pp", "dp"))
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=mesh["dp"])
    with dm.Monitor(quiet_config(log_interval=1), model=model) as monitor:
        monitor.step(1, loss=1.0 if rank == world - 1 else None, tokens=10)
    logging.getLogger("distmetrics").removeHandler(handler)
    return {"said": [line for line in said if "sit on a DeviceMesh of 1 of the 2 ranks" in line]}


def test_a_models_mesh_short_of_the_ranks_naming_nothing_above_it_is_said():
    """FSDP2 over the dp mesh of a pp × dp mesh unflattened from the world's: that mesh's root names
    nothing, so no mesh says the other rank is a pipeline stage, and each stage counted its tokens
    (consumed tokens × pp), unsaid, where the README says it is said once. Now it is (the writer), with
    what it does to norms where the other ranks hold copies (the README's experts sharded over ep alone)."""
    results = run_ranks(_stages_on_an_unflattened_mesh, 2, timeout=120)
    assert len(results[0]["said"]) == 1 and "Pass device_mesh=" in results[0]["said"][0], results[0]
    assert "the gradient, parameter and update norms count every copy" in results[0]["said"][0]  # experts on ep alone


def _eval_time_under_its_written_name(rank: int, world: int, root: str) -> dict:
    """log_eval's time given as ``**{"eval/time_ms": t}``: a negative number on every rank, then tensors,
    negative on rank 0 alone and then on every rank."""
    import torch

    import distmetrics as dm

    out: dict = {}
    with dm.Monitor(quiet_config(output_dir=root, log_interval=1, json_log=True)) as monitor:
        monitor.step(1, loss=1.0, tokens=10)
        try:
            monitor.log_eval(1, loss=2.0, tokens=10, **{"eval/time_ms": -5.0})
        except ValueError as err:
            out["number"] = str(err)
        for step, times in ((2, (-5.0, 4.0)), (3, (-5.0, -5.0))):
            monitor.step(step, loss=1.0, tokens=10)
            try:
                monitor.log_eval(step, loss=2.0, tokens=10, **{"eval/time_ms": torch.tensor(times[rank])})
            except ValueError as err:
                out[step] = str(err)
    out["records"] = [r for r in dm.read_jsonl(f"{root}/metrics.jsonl") if r["kind"] == "eval"] if rank == 0 else []
    return out


def test_eval_time_under_its_written_name_is_checked_as_time_ms_is(tmp_path):
    """log_eval(**{"eval/time_ms": t}) is the time_ms= metric, but skipped its checks: a negative number
    was taken (on one rank it was hidden by the max), a negative tensor on every rank was said after the
    collective without the least any rank gave, and its refused record kept an orphan eval/time_ms/max_rank.
    One check for both spellings: numbers refused at the call on every rank (no collective made), tensors
    in the least a rank gave, the record written without eval/time_ms and its /max_rank."""
    out = run_ranks(_eval_time_under_its_written_name, 2, str(tmp_path), timeout=120)
    for result in out:
        assert result["number"] == ("monitor.log_eval(eval/time_ms=...): -5.0 is refused: accepted values are finite "
                                    "numbers >= 0"), result
        assert "time_ms: the slowest rank's 4.0, the least a rank gave -5.0" in result[2], result
        assert "time_ms: the slowest rank's -5.0, the least a rank gave -5.0" in result[3], result
    records = out[0]["records"]
    assert [r["step"] for r in records] == [2, 3]  # none of the refused call
    for record in records:
        assert record["eval/loss"] == 2.0 and not any(k.startswith("eval/time_ms") for k in record), record
        assert "eval/tokens_per_sec" not in record


def _category_inputs(rank: int, world: int, root: str) -> dict:
    """record_losses with weights as host values and as tensors (bad on one rank); train samples over
    steps 1-2 and 3-4 (log_interval 2), eval samples at log_eval 4."""
    import torch

    import distmetrics as dm

    out: dict = {"refused": {}, "raised": {}}
    losses = torch.tensor([1.0, 2.0])
    with dm.Monitor(quiet_config(output_dir=root, log_interval=2, json_log=True)) as monitor:
        calls = {"list": lambda: monitor.record_losses(losses, ["c", "c"], weights=[-1.0, 2.0]),
                 "nan list": lambda: monitor.record_losses(losses, ["c", "c"], weights=[math.nan, 2.0])}
        for name, call in calls.items():
            try:
                call()
            except (TypeError, ValueError) as err:
                out["refused"][name] = f"{type(err).__name__}: {err}"
        for step in range(1, 5):
            bad = step == 1 and rank == 0  # one sample's weight on one rank, in the first interval
            monitor.record_losses(losses, ["c", "c"], weights=torch.tensor([-1.0 if bad else 1.0, 2.0 + rank]))
            try:
                monitor.step(step, loss=1.0, tokens=10)
            except ValueError as err:
                out["raised"][step] = str(err)
        monitor.record_losses(losses, ["e", "e"], weights=torch.tensor([math.nan if rank else 1.0, 1.0]), split="eval")
        try:
            monitor.log_eval(4, loss=2.0)
        except ValueError as err:
            out["raised"]["eval"] = str(err)
    out["records"] = [r for r in dm.read_jsonl(f"{root}/metrics.jsonl") if r["kind"] != "run"] if rank == 0 else []
    return out


def test_record_losses_weights_must_be_counts(tmp_path):
    """losses [1, 2] with weights [-1, 2] wrote train/loss/c = 3.0, outside its samples' range, without
    a word. Weights given as a list are checked at the call; tensors are not read there (no host sync):
    their bad weights are counted on the device and checked at the log step (log_eval for eval
    samples), where the record is written without the split's categories and every rank raises.
    Truth: the token-weighted mean of the good interval, by hand."""
    out = run_ranks(_category_inputs, 2, str(tmp_path), timeout=120)
    for result in out:
        refused = result["refused"]
        assert refused["list"] == ("ValueError: record_losses(weights=...): the weight -1.0 of sample 0 is refused: "
                                   "accepted values are finite numbers >= 0"), refused
        assert refused["nan list"].startswith("ValueError: record_losses(weights=...): the weight nan of sample 0")
        raised = result["raised"]
        assert set(raised) == {2, "eval"}, raised  # the interval holding the bad weight, on every rank
        assert "record_losses(weights=...): the weights given as tensors in the steps up to step 2 held 1 that " \
               "are NaN, inf or negative" in raised[2], raised
        assert "for monitor.log_eval(step=4) held 1" in raised["eval"] and "eval/loss/<category>" in raised["eval"]
    first, second, evaluation, end = out[0]["records"]
    assert (first["step"], second["step"], evaluation["kind"], end["kind"]) == (2, 4, "eval", "end")
    assert "train/loss/c" not in first and first["train/loss"] == 1.0, first
    weights = [w for rank in range(2) for w in (1.0, 2.0 + rank)] * 2  # steps 3 and 4
    assert second["train/loss/c"] == pytest.approx(sum(w * loss for w, loss in zip(weights, [1.0, 2.0] * 4))
                                                   / sum(weights), rel=1e-12)
    assert evaluation["eval/loss"] == 2.0 and not any(k.startswith("eval/loss/") for k in evaluation), evaluation


RECORD_BAD = {("w/neg", 1, 1): -1.0, ("w/nan", 0, 2): math.nan}  # (name, rank, step) -> a bad tensor weight


def _record_value(rank: int, step: int) -> float:
    return 1.0 + rank + 0.5 * step


def _record_weight(name: str, rank: int, step: int) -> float:
    return RECORD_BAD.get((name, rank, step), 2.0 + rank)


def _record_tensor_weights(rank: int, world: int, root: str) -> dict:
    """monitor.record means weighted by tensors over two intervals (log_interval 2): in the first, a negative
    weight of w/neg on rank 1 and a NaN one of w/nan on rank 0; w/good's weights are good throughout."""
    import torch

    import distmetrics as dm

    raised = {}
    with dm.Monitor(quiet_config(output_dir=root, log_interval=2, json_log=True)) as monitor:
        for step in range(1, 5):
            for name in ("w/neg", "w/nan", "w/good"):
                monitor.record(name, _record_value(rank, step), weight=torch.tensor(_record_weight(name, rank, step)))
            try:
                monitor.step(step, loss=1.0, tokens=10)
            except ValueError as err:
                raised[step] = str(err)
    records = [r for r in dm.read_jsonl(f"{root}/metrics.jsonl") if r["kind"] == "train"] if rank == 0 else []
    return {"raised": raised, "records": records}


def test_a_record_weight_given_as_a_tensor_must_be_a_count(tmp_path):
    """record("v", 1 or 3, weight=tensor(-1 or 2)) wrote v = 5.0, outside [1, 3], and a NaN tensor weight
    wrote NaN, without a word: a number weight is refused at the call, a tensor was never checked. It is not
    read at the call (a device sync): flagged on its device, in a MAX lane, so the log step's record is
    written without the metric, then every rank raises naming it and the lowest rank that gave a bad one.
    Truth: each interval's weighted mean over the ranks and steps, by hand."""
    out = run_ranks(_record_tensor_weights, 2, str(tmp_path), timeout=120)
    for result in out:
        assert set(result["raised"]) == {2}, result["raised"]  # the interval holding the bad weights, every rank
        message = result["raised"][2]
        assert message.startswith("monitor.record(name, weight=...): a tensor given as a weight in the steps up to "
                                  "step 2 held NaN, inf or a negative value"), message
        assert "'w/nan' on rank 0, 'w/neg' on rank 1" in message and "accepted values are finite numbers >= 0" \
            in message and "'w/good'" not in message, message

    def truth(name: str, steps) -> float:
        pairs = [(_record_value(r, s), _record_weight(name, r, s)) for r in range(2) for s in steps]
        return sum(v * w for v, w in pairs) / sum(w for _, w in pairs)

    first, second = out[0]["records"]
    assert (first["step"], second["step"]) == (2, 4)
    assert "w/neg" not in first and "w/nan" not in first, first
    assert first["w/good"] == pytest.approx(truth("w/good", (1, 2)), rel=1e-12), first
    assert not any(key.startswith("_") for key in first), first
    for name in ("w/neg", "w/nan", "w/good"):
        assert second[name] == pytest.approx(truth(name, (3, 4)), rel=1e-12), second


# --- what a record's weight weighs -------------------------------------------------------------
# Only a mean takes a weight; a mean whose weights sum to 0 over every rank and step of an interval is
# left out of that record, said once per name. 2 gloo ranks, log_interval 2, steps 1-6.

OTHER_KINDS = ("sum", "max", "min", "minmax", "all")


def _record_weight_of(name: str, rank: int, step: int) -> float:
    """w/zero weighs 0 everywhere in steps 1-2 and 5-6; w/some 0 on rank 0 only; w/stale is recorded in 1-2."""
    if name == "w/zero":
        return 2.0 if step in (3, 4) else 0.0
    return 0.0 if name == "w/some" and rank == 0 else 1.0 + rank


def _record_weights_by_kind(rank: int, world: int) -> dict:
    import logging

    import torch

    import distmetrics as dm

    said, refused, records = [], {}, {}
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    try:
        with dm.Monitor(quiet_config(log_interval=2)) as monitor:
            for kind in OTHER_KINDS:
                for weight in (2.0, torch.tensor(1.0)):
                    try:
                        monitor.record(f"k/{kind}", 1.0, reduce=kind, weight=weight)
                    except ValueError as err:
                        refused.setdefault(kind, []).append(str(err))
                monitor.record(f"k/{kind}", 1.0 + rank, reduce=kind)  # refused calls claimed nothing
            for step in range(1, 7):
                names = ("w/zero", "w/some") + (("w/stale",) if step <= 2 else ())
                for i, name in enumerate(names):
                    weight = _record_weight_of(name, rank, step)
                    tensor = (i + rank) % 2  # a number or a tensor, each on some rank
                    monitor.record(name, _record_value(rank, step), weight=torch.tensor(weight) if tensor else weight)
                records[step] = monitor.step(step, loss=1.0)
    finally:
        logging.getLogger("distmetrics").removeHandler(handler)
    return {"said": [line for line in said if "monitor.record(" in line], "refused": refused,
            "records": {step: {k: v for k, v in m.items() if k.startswith(("w/", "k/"))}
                        for step, m in records.items() if m is not None}}


def test_a_weight_given_to_a_record_of_another_kind_than_mean_is_refused_at_the_call():
    """record(name, v, reduce="sum", weight=w) (max, min, minmax, all alike) dropped the weight without a word:
    refused at the call, naming the name, the reduce and what takes a weight, claiming nothing."""
    for out in run_ranks(_record_weights_by_kind, 2, timeout=120):
        assert sorted(out["refused"]) == sorted(OTHER_KINDS)
        for kind, messages in out["refused"].items():
            assert messages == [f"monitor.record('k/{kind}', reduce={kind!r}, weight=...): only reduce='mean' takes "
                                f"a weight (a weighted mean); reduce={kind!r} has none to weigh. Pass no weight, or "
                                "reduce='mean'"] * 2, messages
        first = out["records"][2]
        assert (first["k/sum"], first["k/max"], first["k/min"]) == (3.0, 2.0, 1.0), first
        assert first["k/all"] == [1.0, 2.0], first


def _float32_extremes(rank: int, world: int) -> dict:
    import distmetrics as dm

    out = {}
    with dm.Monitor(quiet_config(log_interval=1)) as monitor:
        try:
            monitor.record("q", 10 ** 400, "max")
        except ValueError as err:
            out["refused"] = str(err)
        monitor.record("q", 2.0, "sum")  # the refused call claimed no name: another kind may take it
        monitor.record("x/max", 1e300 if rank else 1.0, "max")
        monitor.record("x/min", 123456789.0, "min")
        monitor.record("x/sum", 123456789.0 if rank else 0.0, "sum")
        out["record"] = monitor.step(1)
    return out


def test_max_and_min_keep_float32s_range_and_digits_and_a_value_refused_claims_no_name():
    """The README's float32 claims of max/min (1e300 written inf, 123456789 as 123456792; sum keeps float64),
    and that a value refused at the call (beyond float64) leaves its name to a later call of another kind."""
    for out in run_ranks(_float32_extremes, 2, timeout=120):
        assert out["refused"].startswith("monitor.record('q'): 100000000000... (401 digits) is beyond float64's "
                                         "range"), out["refused"]
        record = out["record"]
        assert record["q"] == 4.0
        assert record["x/max"] == math.inf and record["x/max/max_rank"] == 1
        assert record["x/min"] == 123456792.0 and record["x/sum"] == 123456789.0


def test_a_record_mean_weighing_0_on_every_rank_is_left_out_and_said_once_per_name():
    """A mean whose weights sum to 0 over every rank and step of an interval has no value: it vanished from
    the record without a word. It is still left out, and said once per name (with the step) by each rank that
    recorded it; a mean weighing 0 on one rank only, and a name no longer recorded, are not said.
    Truth: Σ value·weight / Σ weight over ranks and steps, by hand."""
    def truth(name: str, steps) -> float:
        pairs = [(_record_value(r, s), _record_weight_of(name, r, s)) for r in range(2) for s in steps]
        return sum(v * w for v, w in pairs) / sum(w for _, w in pairs)

    out = run_ranks(_record_weights_by_kind, 2, timeout=120)
    assert out[0]["records"] == out[1]["records"]
    records = out[0]["records"]
    assert "w/zero" not in records[2] and "w/zero" not in records[6], records
    assert records[4]["w/zero"] == pytest.approx(truth("w/zero", (3, 4)), rel=1e-12)
    assert records[2]["w/stale"] == pytest.approx(truth("w/stale", (1, 2)), rel=1e-12)
    for step in (2, 4, 6):
        assert records[step]["w/some"] == pytest.approx(truth("w/some", (step - 1, step)), rel=1e-12)
    for result in out:
        assert result["said"] == [
            "distmetrics: monitor.record('w/zero') is left out of the record of step 2, and of every record where "
            "this recurs: its weights summed to 0 over every rank and step of the interval, and a mean over no "
            "weight is not defined. Said once"], result["said"]


class _WritesKinds(_Flaky):
    """A collector of the user's whose finalize returns Records of the Monitor's kinds beside its own."""

    def finalize(self, metrics, ctx):
        import distmetrics as dm
        from distmetrics.collectors import Record

        return [Record("train", {"flaky/x": 1.0}), Record("end", {"how": "mine"}), {"kind": "mine"},
                Record("mine", {"seen": ctx.step}), dm.Alert("mine_alert", "look")]


def test_a_finalize_returning_a_record_of_the_monitors_kinds_is_left_out_and_said(tmp_path, caplog):
    """A collector's Record("train", ...) wrote a second train record at the step, and Record("end", ...)
    an end record mid-file, which summary read as the job's end; a dict raised a bare AttributeError
    in the write loop after the record. Now they are left out and said once by the rank (not raised: what
    a finalize returns may differ by rank, and a raise on one would leave the others waiting), and the
    record, the collector's own Record and its Alert are written."""
    said, kinds = _finalize_four_steps(tmp_path, caplog, _WritesKinds(0))
    assert len(said) == 1 and said[0].startswith(
        "distmetrics: rank 0: the 'flaky' collector's finalize returned Record('train', ...), Record('end', ...), "
        "a dict, which are not written: it returns Alerts, and Records of kinds"), said
    assert kinds == [("run", 0), ("train", 2), ("mine", 2), ("alert", 2), ("train", 4), ("mine", 4), ("alert", 4),
                     ("end", 4)], kinds


def _finalize_four_steps(tmp_path, caplog, collector) -> tuple:
    """Four steps logged every second with ``collector``: (the warnings of what its finalize returned, the
    (kind, step) of every line of metrics.jsonl)."""
    import distmetrics as dm

    config = quiet_config(output_dir=str(tmp_path), log_interval=2, json_log=True)
    with caplog.at_level("WARNING", logger="distmetrics"), dm.Monitor(config, collectors=[collector]) as monitor:
        for step in range(1, 5):
            monitor.step(step, loss=1.0)
    said = [r.getMessage() for r in caplog.records if "finalize returned" in r.getMessage()]
    return said, [(r["kind"], r["step"]) for r in dm.read_jsonl(tmp_path / "metrics.jsonl")]


class _WritesRecordKeys(_Flaky):
    """A collector of the user's whose Records and Alerts hold the fields every record holds already."""

    def finalize(self, metrics, ctx):
        import distmetrics as dm
        from distmetrics.collectors import Record

        return [Record("mine", {"kind": "train", "step": ctx.step + 1000, "train/loss": 99.0}),
                Record("mine2", {"step": "not-a-step", "v": 1.0}), dm.Alert("odd", "look", {"time": 0}),
                Record("mine3", {"v": 2.0})]


class _ReturnsOne(_Flaky):
    """A finalize returning one Alert, not in a list, at step 2, and at step 4 a list holding an Alert
    whose subclass names the train kind."""

    def finalize(self, metrics, ctx):
        import distmetrics as dm

        class TrainAlert(dm.Alert):
            kind = "train"

        return dm.Alert("odd", "look", {"v": 1.0}) if ctx.step == 2 else [TrainAlert("odd", "again", {"v": 2.0})]


def test_a_finalize_returning_one_alert_writes_it_and_an_alert_of_a_monitors_kind_is_left_out(tmp_path, caplog):
    """One Alert returned as it is raised "TypeError: 'Alert' object is not iterable" at every log step,
    naming no collector; an Alert subclass of kind "train" wrote a second train record at its step."""
    said, kinds = _finalize_four_steps(tmp_path, caplog, _ReturnsOne(0))
    assert kinds == [("run", 0), ("train", 2), ("alert", 2), ("train", 4), ("end", 4)], kinds
    assert len(said) == 1 and "the 'flaky' collector's finalize returned a TrainAlert, which are not written" in \
        said[0], said


def test_a_finalize_returning_fields_named_as_a_records_own_keys_is_left_out_and_said(tmp_path, caplog):
    """A Record's fields were written over the line's own keys: Record("mine", {"kind": "train", "step": 1002})
    landed as a train record at a step never logged (summary: "last step 1004: loss=99"), and a text step made
    a line summary skipped as unreadable, without a word. Left out and said once, as a Record of the Monitor's
    kinds is."""
    said, kinds = _finalize_four_steps(tmp_path, caplog, _WritesRecordKeys(0))
    assert len(said) == 1 and said[0].startswith(
        "distmetrics: rank 0: the 'flaky' collector's finalize returned a Record or Alert with the field(s) 'kind', "
        "'step', 'time', which every record holds already"), said
    assert kinds == [("run", 0), ("train", 2), ("mine3", 2), ("train", 4), ("mine3", 4), ("end", 4)], kinds


class _Sends:
    """Hands over ``queue/depth`` = 3.0 (max), a name it does not declare (no one does)."""

    name, after, writes = "sends", (), ()

    def take_samples(self, ctx):
        import distmetrics as dm

        return [dm.Sample("queue/depth", 3.0, "max")]

    def finalize(self, metrics, ctx):
        return []

    def close(self):
        pass


class _Rewrites:
    """A finalize that sets what ``changes`` says in the reduced metrics (None: removes the key)."""

    name, after, writes = "rewrites", (), ("rw/",)

    def __init__(self, changes):
        self.changes = changes

    def take_samples(self, ctx):
        return []

    def finalize(self, metrics, ctx):
        for key, value in self.changes.items():
            if value is None:
                metrics.pop(key, None)
            else:
                metrics[key] = value
        metrics["rw/own"] = 1.0
        return []

    def close(self):
        pass


@pytest.mark.parametrize("changes, said", [
    ({"kind": "eval", "step": 99, "time": 5}, "wrote 'kind', which the record itself"),
    ({"queue/depth": -1.0}, "wrote 'queue/depth', which the 'sends' collector writes"),
    ({"queue/depth": None, "queue/depth/max_rank": None}, "wrote 'queue/depth', which the 'sends' collector writes")],
    ids=["record keys", "another's value replaced", "another's value removed"])
def test_a_finalize_cannot_set_a_records_own_keys_nor_another_collectors_value(tmp_path, changes, said):
    """A finalize setting kind/step/time wrote every train record as ('eval', 99) (summary: "0 train");
    one replacing or removing a value another collector handed over under a name none declares wrote
    -1.0 for its 3.0, or nothing. Put back, the record written, then a ValueError on every rank. Truth:
    the values handed over."""
    import distmetrics as dm

    config = quiet_config(output_dir=str(tmp_path), log_interval=1, json_log=True)
    with dm.Monitor(config, collectors=[_Sends(), _Rewrites(changes)]) as monitor:
        with pytest.raises(ValueError, match="the 'rewrites' collector's finalize " + said):
            monitor.step(1, loss=1.0)
    (train,) = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] not in ("run", "end")]
    assert (train["kind"], train["step"], train["queue/depth"], train["rw/own"]) == ("train", 1, 3.0, 1.0), train
    assert isinstance(train["time"], str)


def test_a_finalize_setting_a_name_or_value_no_sink_can_store_is_refused_after_the_record(tmp_path):
    """A name holding a newline became a TensorBoard tag and a JSONL key, a 1-D tensor was written as
    the text "tensor([4.5000])" (a complex number as "1j"), and a key that is no str failed the log
    step's sort: left out, the record written, then a ValueError on every rank naming each. A tensor
    of one element is its number; a lane of the collector's own is not checked."""
    import torch

    import distmetrics as dm

    import numpy as np

    changes = {"rw/x\ny": 1.0, "rw/v": torch.tensor([4.5, 1.0]), 7: 1.0, "rw/c": torch.tensor(1j), "rw/j": 1j,
               "rw/a": np.array([1.0, 2.0]), "rw/ok": torch.tensor(3.0), "rw/one": torch.tensor([[4.5]]),
               "rw/np1": np.array([2.5]), np.str_("rw/npname"): 5.0, "_rw/lane": torch.tensor([1.0, 2.0])}
    config = quiet_config(output_dir=str(tmp_path), log_interval=1, json_log=True)
    with dm.Monitor(config, collectors=[_Rewrites(changes)]) as monitor:
        with pytest.raises(ValueError) as raised:
            monitor.step(1, loss=1.0)
    message = str(raised.value)
    assert message.startswith("the 'rewrites' collector's finalize set 'rw/x\\ny': it holds a control character")
    for said in ("'rw/v': a Tensor of shape (2,) and torch.float32, not a number", "7: a int, not a str",
                 "'rw/c': a Tensor of shape () and torch.complex64", "'rw/j': 1j, a complex number",
                 "'rw/a': a ndarray of shape (2,) and float64"):
        assert said in message, (said, message)
    assert message.count("; ") == 5 and "lane" not in message, message  # one element, a str of numpy's: taken
    (train,) = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert {k: v for k, v in train.items() if k.startswith("rw/")} == {"rw/ok": 3.0, "rw/own": 1.0, "rw/one": 4.5,
                                                                        "rw/np1": 2.5, "rw/npname": 5.0}


class _SendsEvalAcc(_Sends):
    name = "acc"

    def take_samples(self, ctx):
        import distmetrics as dm

        return [dm.Sample("eval/acc", 0.25, "mean")]


def test_a_collectors_name_agreed_first_stays_its_own_after_log_eval_clashes_with_it(tmp_path):
    """README: the kind of record whose names were agreed with it first keeps it, and each later
    log_eval that sends it is written without it, then raises. The refused log_eval kept its claim,
    so the collector's eval/acc was refused from the next train log step on: written nowhere."""
    import distmetrics as dm

    config = quiet_config(output_dir=str(tmp_path), log_interval=2, json_log=True)
    with dm.Monitor(config, collectors=[_SendsEvalAcc()]) as monitor:
        for step in range(1, 7):
            monitor.step(step, loss=1.0)
            if step % 2 == 0:
                with pytest.raises(ValueError, match="in eval records .monitor.log_eval. would write 'eval/acc'"):
                    monitor.log_eval(step, loss=2.0, acc=0.75)
    records = [(r["kind"], r["step"], r.get("eval/acc")) for r in dm.read_jsonl(tmp_path / "metrics.jsonl")
               if r["kind"] in ("train", "eval")]
    assert records == [(kind, step, 0.25 if kind == "train" else None) for step in (2, 4, 6)
                       for kind in ("train", "eval")], records


def test_losses_and_router_statistics_recorded_in_and_out_of_inference_mode_add_up(tmp_path):
    """The interval's first record_losses or record_moe made under torch.inference_mode() (an evaluation's
    forward) made its accumulators inference tensors: the next call outside it raised torch's "Inplace
    update to inference tensor outside InferenceMode" after adding its sums but not its weights (a train
    step's monitor.step raised, and the means doubled). Truth: float64 means of what was recorded."""
    import torch

    import distmetrics as dm

    config = quiet_config(output_dir=str(tmp_path), log_interval=2, json_log=True)
    with dm.Monitor(config) as monitor:
        with torch.inference_mode():
            monitor.record_losses(torch.tensor([1.0, 3.0]), ["a", "b"], split="eval")
            monitor.record_moe(aux_loss=0.5, tokens_per_expert=torch.tensor([[1.0, 2.0, 3.0, 2.0]]))
            monitor.record_losses(torch.tensor([1.0, 3.0]), ["a", "b"])
        monitor.record_losses(torch.tensor([5.0, 8.0]), ["a", "b"], split="eval")
        evaluated = monitor.log_eval(1, loss=1.0)
        monitor.step(1, loss=1.0)
        monitor.record_losses(torch.tensor([5.0, 7.0]), ["a", "b"])
        monitor.record_moe(aux_loss=1.5, tokens_per_expert=torch.tensor([[3.0, 2.0, 1.0, 2.0]]))
        record = monitor.step(2, loss=1.0)
    assert (evaluated["eval/loss/a"], evaluated["eval/loss/b"]) == (3.0, 5.5)
    assert (record["train/loss/a"], record["train/loss/b"]) == (3.0, 5.0)
    assert record["moe/aux_loss"] == 1.0 and record["moe/load_imbalance"] == 1.0  # the counts summed: [4, 4, 4, 4]


def test_a_value_another_thread_records_while_close_takes_the_interval_is_refused_not_written(tmp_path, caplog):
    """close() took back the values recorded after the last monitor.step (said, not written), let go of
    the lock, and took it again to take the interval for its record: a value another thread recorded
    in between (1 to 17 per run of a recording thread) was written into the record of steps up to the
    last, as that step's. The thread's record() now raises, as after close(). Here the other thread
    records at that very moment (close's log step, wrapped)."""
    import threading

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(output_dir=str(tmp_path), log_interval=4, json_log=True))
    raised = []

    def late():
        try:
            monitor.record("x/sum", 1e5, "sum")
        except RuntimeError as err:
            raised.append(str(err))

    log = monitor._log

    def log_with_a_value_recorded_before(*args, **kwargs):
        thread = threading.Thread(target=late)
        thread.start()
        thread.join()
        return log(*args, **kwargs)

    for step in range(1, 7):
        monitor.record("x/sum", 1.0, "sum")
        monitor.step(step, loss=1.0)
    monitor.record("x/sum", 1e10, "sum")  # after the last step: taken back and said
    monitor._log = log_with_a_value_recorded_before
    with caplog.at_level("WARNING", logger="distmetrics"):
        monitor.close()
    records = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["step"], r["x/sum"]) for r in records] == [(4, 4.0), (6, 2.0)], records
    assert raised == ["this Monitor is closed; create a new one to record more"], raised
    assert any("'x/sum' recorded after the last monitor.step" in r.getMessage() for r in caplog.records)


def test_a_collectors_own_lanes_are_its_name_s_and_never_the_monitors():
    """A user's collector may send lanes of its own, _<its name>/...; one named as a prefix of the
    Monitor's lanes ('ranks', 'monitor') has none: '_ranks/timers/x' is the timers' lane the stragglers
    collector reads, and '_monitor/take_samples_failed' would make every rank raise."""
    from distmetrics.collectors.base import _checked
    from distmetrics.reduce import Sample

    class Mine:
        def __init__(self, name):
            self.name = name

    assert [s.name for s in _checked([Sample("_mine/raw", 1.0, "sum")], {}, {}, {}, Mine("mine"))] == ["_mine/raw"]
    for name, lane in (("mine", "_other/raw"), ("ranks", "_ranks/timers/x"),
                       ("monitor", "_monitor/take_samples_failed")):
        with pytest.raises(ValueError, match=f"metric name '{lane}' is refused: names are non-empty, do not start"):
            _checked([Sample(lane, 1.0, "max")], {}, {}, {}, Mine(name))


@pytest.mark.parametrize("switch", [True, False], ids=["switch on", "switch off"])
def test_a_collector_named_as_a_built_in_is_refused_saying_what_runs_in_its_place(tmp_path, switch):
    """The refusal said the name was reserved "where its switch is off too" with the switch on, and not how to
    run one's own in the built-in's place."""
    import distmetrics as dm

    collector = _Named(0)
    collector.name = "energy"
    with pytest.raises(ValueError) as raised:
        dm.Monitor(quiet_config(output_dir=str(tmp_path), log_energy=switch), collectors=[collector])
    assert str(raised.value) == (
        "distmetrics cannot start: rank 0: a collector of yours is named 'energy', the name of a built-in collector "
        "(held whether its config switch is on or off); collector names must be unique. One made of the built-in's "
        "own class (an EnergyCollector for one GPU) runs in its place where its switch is off")


@pytest.mark.parametrize("name", ["norms", "stragglers"])
def test_a_collector_named_as_a_built_in_the_monitor_does_not_make_is_refused(tmp_path, name):
    """'norms' on a Monitor without model=, 'stragglers' on one rank: accepted, then taken for the
    built-in by its name, so every monitor.step raised AttributeError naming neither."""
    import distmetrics as dm

    collector = _Named(0)
    collector.name = name
    with pytest.raises(ValueError, match=f"a collector of yours is named '{name}', the name of a built-in collector"):
        dm.Monitor(quiet_config(output_dir=str(tmp_path)), collectors=[collector])


class _NumpyValues:
    """A collector of the user's whose finalize sets numpy scalars, a 0-d array and a 0-d tensor."""

    name, after, writes = "npv", (), ("npv/",)

    def take_samples(self, ctx):
        return []

    def finalize(self, metrics, ctx):
        import numpy as np
        import torch

        metrics.update({"npv/f32": np.float32(1.5), "npv/i64": np.int64(7), "npv/zero_d": np.array(2.25),
                        "npv/tensor": torch.tensor(0.5, dtype=torch.float64), "npv/flag": np.bool_(True)})
        return []

    def close(self):
        pass


def test_numpy_and_tensor_values_a_collector_sets_reach_every_dashboard_as_in_metrics_jsonl(tmp_path):
    """metrics.jsonl wrote them as numbers; TensorBoard and W&B left them out without a word (only
    Python numbers were taken for the dashboards)."""
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import distmetrics as dm
    from tests.wandb_reader import read_offline_run

    cfg = quiet_config(output_dir=str(tmp_path), log_interval=1, json_log=True, tensorboard=True,
                       wandb_project="p", wandb_mode="offline")
    with dm.Monitor(cfg, collectors=[_NumpyValues()]) as monitor:
        monitor.step(1, loss=1.0)
    expected = {"npv/f32": 1.5, "npv/i64": 7.0, "npv/zero_d": 2.25, "npv/tensor": 0.5, "npv/flag": 1.0}
    (record,) = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert {k: float(v) for k, v in record.items() if k.startswith("npv/")} == expected
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {tag: acc.Scalars(tag)[0].value for tag in acc.Tags()["scalars"] if tag.startswith("npv/")} == expected
    (row,) = [r for r in read_offline_run(str(tmp_path))["history"] if "train/loss" in r]
    assert {k: float(v) for k, v in row.items() if k.startswith("npv/")} == expected


def test_a_float64_tensor_changed_in_place_after_the_call_counts_as_it_was_at_the_call(tmp_path):
    """A token counter reused every step (``tok.zero_()``, ``tok += n``) and passed as
    ``tokens=`` and to ``monitor.record``: float64 was kept as the caller's own storage, so the
    interval's first value was read changed (consumed tokens 224 for 204, a sum of 143 for 123);
    other dtypes were copied. Truth: the counts added up in Python."""
    import torch

    import distmetrics as dm

    tok = torch.zeros((), dtype=torch.float64)
    with dm.Monitor(quiet_config(output_dir=str(tmp_path), log_interval=4, log_throughput=True)) as monitor:
        consumed, records = 0, []
        for step in range(1, 9):
            tok.zero_()
            for micro in range(2):
                tok += 10 * step + micro
            consumed += 20 * step + 1
            records.append(monitor.step(step, loss=1.0, tokens=tok))
            for reduce in ("sum", "max", "min"):
                monitor.record(f"u/{reduce}", tok, reduce=reduce)
    four, eight = records[3], records[7]
    assert four["train/consumed_tokens"] == 204.0 and eight["train/consumed_tokens"] == consumed == 728.0
    # records made after step s's monitor.step are in the next interval: steps 1-3, then 4-7
    assert (four["u/sum"], four["u/max"], four["u/min"]) == (123.0, 61.0, 21.0)
    assert (eight["u/sum"], eight["u/max"], eight["u/min"]) == (sum(20 * s + 1 for s in range(4, 8)), 141.0, 81.0)


def _lr_changed_in_place(rank: int, world: int, out: str) -> list:
    import torch

    import distmetrics as dm

    lr = torch.zeros((), dtype=torch.float64)
    with dm.Monitor(quiet_config(output_dir=out, log_interval=4, json_log=True)) as monitor:
        for step in range(1, 7):
            lr.fill_(step / 10)
            monitor.step(step, loss=1.0, lr=lr if rank == 1 else None)
            lr.fill_(99.0)  # the scheduler's step, in place
    return [(r["step"], r["train/lr"]) for r in dm.read_jsonl(f"{out}/metrics.jsonl") if r["kind"] == "train"] \
        if rank == 0 else []


def test_an_lr_tensor_changed_in_place_after_the_call_is_written_as_it_was_at_close(tmp_path):
    """The writer rank passes no lr, rank 1 a float64 tensor its scheduler fills in place after
    each step: the record close() writes took rank 1's lr as changed (99.0), not step 6's 0.6."""
    assert run_ranks(_lr_changed_in_place, 2, str(tmp_path), timeout=120)[0] == [(4, 0.4), (6, 0.6)]


def _prefix_shared_with_a_failing_collector(rank: int, world: int, root: str) -> list:
    import distmetrics as dm

    class A:
        name, after, writes = "a", (), ("d/",)
        calls = 0

        def take_samples(self, ctx):
            self.calls += 1
            if self.calls == 2 and rank == 1:
                raise RuntimeError("A fails on rank 1")
            return [dm.Sample("d/a", 1.0, "sum")]

        def finalize(self, metrics, ctx):
            return []

        def close(self):
            pass

    class B(A):
        name, after, writes = "b", ("a",), ("d/b_only",)

        def take_samples(self, ctx):
            return [dm.Sample("d/b_only", 10.0, "sum")]

    with dm.Monitor(quiet_config(output_dir=root, log_interval=2, json_log=True), collectors=[A(), B()]) as monitor:
        for step in range(1, 7):
            try:
                monitor.step(step)
            except dm.CollectorFailed:
                pass
    return [(r["step"], r.get("d/a"), r.get("d/b_only")) for r in dm.read_jsonl(f"{root}/metrics.jsonl")
            if r["kind"] == "train"] if rank == 0 else []


def test_a_failing_collector_leaves_out_its_own_values_not_those_of_one_sharing_its_prefix(tmp_path):
    """A writes 'd/', B names A in after and writes 'd/b_only': when A's take_samples raised on rank 1,
    B's healthy d/b_only (2 ranks x 10.0) went with A's values. Truth: the values each rank sent."""
    got = run_ranks(_prefix_shared_with_a_failing_collector, 2, str(tmp_path), timeout=120)[0]
    assert got == [(2, 2.0, 20.0), (4, None, 20.0), (6, 2.0, 20.0)]


@pytest.mark.parametrize("how", ["none", "non-reentrant", "reentrant", "checkpoint_wrapper", "nested reentrant",
                                 "deep reentrant", "create_graph"])
def test_records_in_a_forward_recomputed_by_activation_checkpointing_count_once(how, caplog):
    """A block's forward that records a count and a router's aux loss and counts, checkpointed: the
    forward run again inside backward counted each twice (a sum 8 for 4; a mean weighing the
    checkpointed block twice: 1.67 for 2.0), also under no_grad there; one 80 modules deep counted
    twice (the stack was looked through 200 frames up). A record from a backward hook still counts,
    under create_graph=True too, and so does one from a hook inside a reentrant checkpoint, which
    runs in the checkpoint's own backward (it was left out: not counted at all). Truth: one call per
    block per step."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    import distmetrics as dm

    monitor = dm.Monitor(quiet_config(log_interval=2))

    class Block(torch.nn.Module):
        def __init__(self, value):
            super().__init__()
            self.fc, self.value = torch.nn.Linear(4, 4), value

        def forward(self, x):
            monitor.record("calls", 1.0, reduce="sum")
            with torch.no_grad():  # router statistics are often counted so
                monitor.record("calls/no_grad", 1.0, reduce="sum")
            monitor.record("router/entropy", self.value)
            monitor.record_moe(aux_loss=self.value, tokens_per_expert=torch.tensor([[3.0, 1.0]]))
            return torch.relu(self.fc(x))

    torch.manual_seed(0)
    blocks = [Block(1.0), Block(3.0)]  # the first checkpointed (selective), the second not
    first = checkpoint_wrapper(blocks[0]) if how == "checkpoint_wrapper" else blocks[0]
    if how == "deep reentrant":
        for _ in range(80):
            first = torch.nn.Sequential(first)
    hooked = [block.fc.weight.register_hook(lambda grad: monitor.record("hook/calls", 1.0, reduce="sum"))
              for block in blocks]  # the first's fires in a reentrant checkpoint's backward
    for step in (1, 2):
        x = torch.randn(2, 4, requires_grad=True)
        if how in ("non-reentrant", "reentrant", "deep reentrant"):
            y = checkpoint(first, x, use_reentrant=how != "non-reentrant")
        elif how == "nested reentrant":  # the inner checkpoint's forward runs under the outer one's recompute
            y = checkpoint(lambda h: checkpoint(first, h, use_reentrant=True), x, use_reentrant=True)
        else:
            y = first(x)
        blocks[1](y).sum().backward(create_graph=how == "create_graph")
        metrics = monitor.step(step)
    for hook in hooked:
        hook.remove()
    monitor.close()
    assert (metrics["calls"], metrics["calls/no_grad"], metrics["hook/calls"]) == (4.0, 4.0, 4.0)
    assert metrics["router/entropy"] == metrics["moe/aux_loss"] == 2.0
    said = "came from a forward that activation checkpointing runs again" in caplog.text
    assert said == (how not in ("none", "create_graph"))
