"""What the file sinks write, byte for byte where it matters: the JSONL encoders (orjson, and
the standard library as the fallback) write the same values; the TensorBoard record checksum
(google-crc32c) equals TensorBoard's own."""

import itertools
import json
import logging
import math
import random

import numpy as np
import pytest

from distmetrics.reduce import PerRank
from distmetrics.sinks import jsonl

AWKWARD = {"finite": 0.1, "tiny": 1e-05, "huge": 1e16, "nan": math.nan, "inf": -math.inf,
           "per_rank": PerRank([1.0, None, 3.0]), "numpy": np.float64(2.5), "numpy_int": np.int64(3),
           "big": 2**70, "text\udc80": 1, "none": None, "flag": True, "list": [1.0, math.nan]}


@pytest.mark.parametrize("case", ["awkward", "plain"])
def test_orjson_and_the_standard_library_write_the_same_values(case, monkeypatch):
    pytest.importorskip("orjson")
    metrics = AWKWARD if case == "awkward" else {f"m{i}": random.random() for i in range(1000)}
    fast = jsonl._line("train", 7, metrics)
    monkeypatch.setattr(jsonl, "orjson", None)
    slow = jsonl._line("train", 7, metrics)
    decode = lambda line: {k: v for k, v in json.loads(line).items() if k != "time"}  # noqa: E731
    assert decode(fast) == decode(slow)
    assert fast.endswith(b"\n") and fast.count(b"\n") == 1


def test_awkward_values_read_back_as_written(tmp_path):
    import distmetrics as dm

    sink = jsonl.JsonlSink(tmp_path / "m.jsonl")
    sink.log(AWKWARD, 1, "train")
    sink.close()
    (record,) = dm.read_jsonl(tmp_path / "m.jsonl")
    assert record["finite"] == 0.1 and record["tiny"] == 1e-05 and record["huge"] == 1e16
    assert math.isnan(record["nan"]) and record["inf"] == -math.inf
    assert record["per_rank/rank0"] == 1.0 and "per_rank/rank1" not in record and record["per_rank/rank2"] == 3.0
    assert record["numpy"] == 2.5 and record["big"] == 2**70 and record["none"] is None and record["flag"] is True


def test_a_line_torn_inside_a_utf8_character_is_skipped_and_counted(tmp_path, caplog):
    """A SIGKILL during a write can cut the last line inside a multi-byte character (orjson writes
    'café' as UTF-8): read_jsonl raised UnicodeDecodeError instead of skipping the cut-short line, as
    its docstring, summary and the report do. Skipped and counted in one warning, and the whole records
    read back as json reads them; a line holding a byte that is not UTF-8 (a Latin-1 name) is kept with
    the byte replaced, as summary and the report read it."""
    import distmetrics as dm

    pytest.importorskip("orjson")  # the standard library writes the character as an ASCII escape
    path = tmp_path / "m.jsonl"
    sink = jsonl.JsonlSink(path)
    for step in (1, 2, 3):
        sink.log({"grad_norm/caf\u00e9": step / 4, "train/loss": 1.0 / step}, step, "train")
    sink.close()
    whole = path.read_bytes()
    last = whole.splitlines(keepends=True)[-1]
    cut = whole[:len(whole) - len(last) + last.index("\u00e9".encode()) + 1]  # inside the 2-byte character
    assert cut[-1:] == b"\xc3"
    truth = [json.loads(line) for line in cut.splitlines()[:-1]]
    caplog.set_level(logging.WARNING, logger="distmetrics")
    path.write_bytes(cut)
    assert list(dm.read_jsonl(path)) == truth and len(truth) == 2
    path.write_bytes(whole.replace(b"caf\xc3\xa9", b"caf\xe9", 1) + cut[len(whole) - len(last):])
    latin = json.loads(whole.splitlines()[0].replace("caf\u00e9".encode(), "caf\ufffd".encode()))
    assert list(dm.read_jsonl(path)) == [latin] + [json.loads(line) for line in whole.splitlines()[1:]]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "skipped 1 line(s)" in said[0] and "skipped 1 line(s)" in said[1], said


def test_a_file_saved_with_cr_line_endings_or_a_byte_order_mark_reads_the_same(tmp_path, caplog):
    """read_jsonl splits lines at \\n: a file another tool saved with \\r endings read as no record at all,
    and a byte-order mark cost the first record; both read as json reads the lines, with no warning."""
    import distmetrics as dm

    path = tmp_path / "m.jsonl"
    sink = jsonl.JsonlSink(path)
    for step in (1, 2, 3):
        sink.log({"train/loss": 1.0 / step}, step, "train")
    sink.close()
    whole = path.read_bytes()
    truth = [json.loads(line) for line in whole.splitlines()]
    caplog.set_level(logging.WARNING, logger="distmetrics")
    for saved in (whole.replace(b"\n", b"\r"), whole.replace(b"\n", b"\r\n"), b"\xef\xbb\xbf" + whole):
        path.write_bytes(saved)
        assert list(dm.read_jsonl(path)) == truth and len(truth) == 3, saved[:40]
    path.write_bytes(b'{"kind": "train", "step": 1,\r"train/loss": 2.0}\n')  # a raw \r between tokens: whitespace
    assert list(dm.read_jsonl(path)) == [{"kind": "train", "step": 1, "train/loss": 2.0}]
    assert caplog.records == []


@pytest.mark.parametrize("encoder", ["orjson", "standard library"])
def test_numpy_scalars_are_written_as_numbers_and_read_back(encoder, tmp_path, monkeypatch):
    import distmetrics as dm

    if encoder == "orjson":
        pytest.importorskip("orjson")
    else:
        monkeypatch.setattr(jsonl, "orjson", None)
    sink = jsonl.JsonlSink(tmp_path / "m.jsonl")
    sink.log({"f32": np.float32(1.5), "i64": np.int64(3), "nan32": np.float32("nan"), "inf32": np.float32("-inf"),
              "f16": np.float16(0.5), "flag": np.bool_(True), "zero_d": np.array(2.25)}, 1, "train")
    sink.close()
    (record,) = dm.read_jsonl(tmp_path / "m.jsonl")
    assert (record["f32"], record["i64"], record["f16"], record["zero_d"]) == (1.5, 3, 0.5, 2.25)
    assert type(record["i64"]) is int and record["flag"] is True
    assert math.isnan(record["nan32"]) and record["inf32"] == -math.inf


def test_the_record_checksum_is_tensorboards():
    pytest.importorskip("google_crc32c")
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference

    from distmetrics.sinks.tensorboard import masked_crc32c

    fast = masked_crc32c()
    rng = random.Random(0)
    for size in (0, 1, 8, 1000, 65537):
        data = bytes(rng.getrandbits(8) for _ in range(size))
        assert fast(data) == reference(data)


def test_a_jsonl_line_is_the_record_head_first_and_a_metric_named_like_the_head_still_wins():
    """The head (kind, step, time) and the metrics are encoded apart and joined: the line reads
    back as the merged record, head first; a metric called ``step`` or ``kind`` takes the merged
    path and wins, as it always did; NaN goes the exact way."""
    import json

    from distmetrics.sinks.jsonl import _line

    line = _line("train", 5, {"a": 1.5, "b/c": 2, "grad_norm/x": 0.25})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    record = json.loads(line)
    assert list(record)[:3] == ["kind", "step", "time"] and record["kind"] == "train" and record["step"] == 5
    assert {k: record[k] for k in ("a", "b/c", "grad_norm/x")} == {"a": 1.5, "b/c": 2, "grad_norm/x": 0.25}
    assert json.loads(_line("alert", 7, {"step": 3, "kind": "x"}))["step"] == 3
    assert json.loads(_line("train", 1, {"a": float("nan")}))["a"] == "NaN"
    assert set(json.loads(_line("run", 0, {}))) == {"kind", "step", "time"}


def test_the_head_kept_per_kind_reads_back_as_the_record_for_any_kind_and_step():
    """The head is text made from each kind's encoding and kept per kind: kinds that need
    escaping (a quote, a backslash, a control character, non-ASCII text), a per cent sign, more
    kinds than are kept, and steps that are not plain ints (numpy, bool, beyond 64 bits) read
    back exactly as the record given, with the time now as datetime reads it."""
    kinds = ['say "hi"', "back\\slash", "tab\tnew\nline", "grün", "100% %d %s", "train"] + [f"kind{i}" for i in range(80)]
    steps = [0, 7, np.int64(9), True, 2**70]
    metrics = {"a": 1.5, "b/c": 2}
    for kind, step in itertools.product(kinds, steps):
        line = jsonl._line(kind, step, metrics)
        record = json.loads(line)
        assert list(record)[:3] == ["kind", "step", "time"], line
        expected = step.item() if isinstance(step, np.generic) else step
        assert record["kind"] == kind and record["step"] == expected and type(record["step"]) is type(expected)
        assert {k: record[k] for k in metrics} == metrics
        assert len(record["time"]) == len("2026-11-22T06:09:24.123+00:00") and record["time"].endswith("+00:00")
    assert len(jsonl._KIND_HEADS) <= jsonl.FiniteCheck.KEEP
    import datetime as dt

    for _ in range(2000):  # the head's clock: between what datetime reads before and after
        before = dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")
        now = json.loads(jsonl._line("train", 1, metrics))["time"]
        assert before <= now <= dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds"), now


@pytest.mark.parametrize("odd", [math.nan, math.inf, -math.inf, None, np.float32("nan"), "text", 1e308])
def test_one_odd_value_among_many_finite_ones_is_written_as_strict_json(odd):
    """The encoder skips its search for ``null`` when the values' sum is finite: one NaN, Inf,
    None or numpy NaN among 1,000 floats, and finite values whose sum overflows (1e308 twice),
    still come out as strict JSON that reads back to the values given."""
    pytest.importorskip("orjson")
    metrics = {f"m{i}": i / 7 for i in range(1000)}
    metrics["m500"] = odd
    if odd == 1e308:
        metrics["m501"] = 1e308
    line = jsonl._line("train", 3, metrics)
    record = jsonl.decode_line(line.decode())
    assert b"null" not in line or odd is None
    for name, value in metrics.items():
        got = record[name]
        assert got != got if value != value else got == value, name  # NaN: the one value unequal to itself


def test_the_record_time_is_what_datetime_writes():
    """The head's time is formatted once per second and the milliseconds added: the text equals
    ``datetime.isoformat(timespec="milliseconds")`` in UTC, at whole seconds, at a fraction that
    rounds up into the next second, and at random times; the time now lies between what
    datetime reads just before and just after."""
    import datetime as dt

    rng = random.Random(5)
    times = [rng.uniform(0, 4e9) for _ in range(20000)]
    times += [float(s) + f for s in (0, 1037114423, 1795000000) for f in (0.0, 0.0005, 0.999, 0.9995, 0.9999996)]
    for t in times:
        assert jsonl.utc_now(t) == dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="milliseconds"), t
    for _ in range(2000):  # the clock read in nanoseconds: between what datetime reads before and after
        before = dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")
        now = jsonl.utc_now()
        assert before <= now <= dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds"), now


@pytest.mark.parametrize("case", ["arrays of two shapes", "tensors of two sizes", "float32 near the top"])
def test_values_that_are_not_python_numbers_are_written_and_never_added_up(case, tmp_path):
    """The finite check adds up only floats, ints and bools: numpy arrays of shapes that do not
    broadcast, tensors of sizes that do not match, and float32 scalars whose sum overflows are
    found by a pass over the first such record and left out, so no value's own arithmetic runs
    (no error that would stop the sink, no numpy warning, even with warnings as errors) and
    every record is written."""
    import warnings

    import torch

    odd = {"arrays of two shapes": [np.zeros(2), np.zeros(3)],
           "tensors of two sizes": [torch.zeros(2), torch.zeros(3)],
           "float32 near the top": [np.float32(3e38)] * 40}[case]
    sink = jsonl.JsonlSink(tmp_path / "m.jsonl")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in (1, 2, 3):
            metrics = {f"m{i:02d}": float(i) for i in range(40)}
            metrics.update({f"odd{i:02d}": value for i, value in enumerate(odd)})
            if step == 3:  # the same kind and size, another layout: an odd value where a number was
                metrics["m05"], metrics["odd00"] = odd[0], 5.0
            sink.log(metrics, step, "train")
    sink.close()
    records = list(jsonl.read_jsonl(tmp_path / "m.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[2]["odd00"] == 5.0 and records[0]["m39"] == 39.0


def test_the_record_time_at_the_epoch_in_a_fresh_process():
    """The per-second cache starts empty: the first time asked for is formatted in full, even
    one in the first second of 1970."""
    from tests.dist_utils import run_python

    child = run_python("-c", "from distmetrics.sinks.jsonl import utc_now; print(utc_now(0.5))")
    assert child.stdout.strip() == "1970-01-01T00:00:00.500+00:00", child.stderr


def test_the_console_shows_the_hottest_gpu_and_a_max_only_timer_block():
    """verbosity 1 promises temperature: the line read gpu/temperature_c, which a minmax reduction
    never writes (gpu/temperature_c/max is there). Under timing_log_option: max no timer block was
    printed; Megatron prints "max time across ranks (ms):"."""
    from distmetrics.sinks.console import format_timer_block, format_train_line

    line = format_train_line({"gpu/temperature_c/max": 60.0, "gpu/temperature_c/min": 55.0}, 2, telemetry=True)
    assert "temperature_c 60.0" in line
    block = format_timer_block({"timers/fwd": 5.0, "timers/fwd/max_rank": 1, "timers/step": 12.5,
                                "timers/step/max_rank": 0})
    assert block.splitlines()[0] == "max time across ranks (ms):" and "fwd" in block and ": 5.00" in block
    both = format_timer_block({"timers/fwd": 5.0, "timers/fwd/min": 4.0, "timers/fwd/max_rank": 1})
    assert both.splitlines()[0] == "(min, max) time across ranks (ms):" and "(4.00, 5.00)" in both


def test_the_console_timer_block_lists_timers_in_the_order_they_were_made(tmp_path, caplog):
    """The block listed the timers alphabetically (the record's order: batch-generator before
    forward-backward before optimizer), where Megatron's training log lists them in its loop's order.
    They come in the order the writer's timers were made; one made on another rank only comes after,
    in the record's order. Under ``max`` too."""
    import distmetrics as dm
    from distmetrics.sinks.console import format_timer_block

    caplog.set_level(logging.INFO, logger="distmetrics.console")
    config = dm.MetricsConfig(log_interval=2, timing_log_level=1, output_dir=str(tmp_path), tensorboard=False,
                              log_progress=False, json_log=False, straggler_window=0)
    with dm.Monitor(config) as monitor:
        for step in (1, 2):  # the step timer's first lap ends at step 2
            for name in ("forward-backward", "optimizer", "batch-generator"):
                monitor.timers(name, 1).start()
                monitor.timers(name).stop()
            monitor.step(step)
    [block] = [r.getMessage() for r in caplog.records if "time across ranks" in r.getMessage()]
    assert [line.split()[0] for line in block.splitlines()[1:]] == ["step", "forward-backward", "optimizer",
                                                                    "batch-generator"]
    record = {"timers/a": 1.0, "timers/a/max_rank": 0, "timers/b": 2.0, "timers/b/max_rank": 0,
              "timers/c": 3.0, "timers/c/max_rank": 1}
    block = format_timer_block(record, ("c", "a"))  # b: made on rank 1 only
    assert [line.split()[0] for line in block.splitlines()[1:]] == ["c", "a", "b"]


def test_the_console_line_rounds_into_the_next_unit_and_keeps_sub_millisecond_steps():
    """999,960 tokens/s read "1000.0k tok/s", and a 0.4 ms step "0 ms"."""
    from distmetrics.sinks.console import format_eval_line, format_train_line

    line = format_train_line({"train/tokens_per_sec": 999_960.0, "train/step_time_ms": 0.42}, 2)
    assert "1.0M tok/s" in line and "0.42 ms" in line, line
    line = format_train_line({"train/tokens_per_sec": 999_940.0, "train/step_time_ms": 156.4}, 2)
    assert "999.9k tok/s" in line and "156 ms" in line, line
    assert "0.9 ms" in format_eval_line({"eval/loss": 1.0, "eval/time_ms": 0.9}, 2)


def test_the_trend_mark_skips_a_non_finite_loss_and_moe_fields_are_named(caplog):
    """The README's reading of the line: no mark where the loss is NaN, the next line compared with
    the last finite loss; aux and imbal are moe/aux_loss and moe/load_imbalance."""
    from distmetrics.sinks.console import ConsoleSink

    sink = ConsoleSink()
    with caplog.at_level(logging.INFO, logger="distmetrics.console"):
        for step, loss in ((1, 2.0), (2, math.nan), (3, 2.5)):
            sink.log({"train/loss": loss, "moe/aux_loss": 0.0123, "moe/load_imbalance": 1.456}, step, "train")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(":: step")]
    assert [line.split(" loss ")[0] for line in lines] == [":: step 1  ", ":: step 2  ", ":: step 3 /"]
    assert lines[0].endswith("| aux 0.0123 | imbal 1.46")


def test_the_console_shows_a_small_loss_norm_or_gap_in_exponent_form_not_as_zero():
    """4 decimals showed a loss of 1e-8 and a norm of 3e-9 as "loss 0.0000 | norm 0.0000" (a run that
    converged, or one whose gradients vanished, read as exact zeros)."""
    from distmetrics.sinks.console import format_eval_line, format_train_line

    line = format_train_line({"train/loss": 1e-8, "grad_norm": 3e-9, "moe/aux_loss": 2.5e-4, "train/lr": 1e-9}, 5)
    assert line.endswith("loss 1.000e-08 | norm 3.000e-09 | lr 1.00e-09 | aux 2.500e-04"), line
    assert "loss 0.0012 | norm 0.0000" in format_train_line({"train/loss": 0.00123, "grad_norm": 0.0}, 5)
    eval_line = format_eval_line({"eval/loss": 9.99e-4, "eval/gap": -2e-7}, 3)
    assert eval_line == ">> eval step 3 | loss 9.990e-04 | gap -2.000e-07", eval_line


def test_the_console_line_never_shows_100_percent_early_nor_units_on_nan_or_inf():
    """Step 7,999 of 8,000 read "[100.0%]", inf tokens/s "infG tok/s", a NaN gap "+nan" and a
    40 ns timer "4e-05 ms"."""
    from distmetrics.sinks.console import format_eval_line, format_train_line

    line = format_train_line({"train/tokens_per_sec": math.inf, "train/step_time_ms": 0.00004}, 7999, 8000)
    assert "[99.9%]" in line and " inf tok/s | 0.00 ms" in line, line
    assert "[100.0%]" in format_train_line({}, 8000, 8000)
    assert "| nan tok/s" in format_train_line({"train/loss": 1.0, "train/tokens_per_sec": math.nan}, 2)
    assert format_eval_line({"eval/gap": math.nan}, 3) == ">> eval step 3 | gap nan"
    assert format_eval_line({"eval/gap": -0.5}, 3) == ">> eval step 3 | gap -0.5000"
