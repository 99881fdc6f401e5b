"""The reducer on 4 real gloo ranks: every reduce kind against values computed by hand, ranks
holding different names, and the collective count (≤ 1 per kind in steady state)."""

import math
import re

import pytest

from tests.dist_utils import quiet_config, run_ranks

WORLD = 4
VECTOR = ("v/a", "v/b", "v/c")
"""A vector sample's names on ranks 0-2; rank 3 sends v/a and v/c, and v/b as a sum of its own while
the clash lasts (log steps 1-3)."""
CLASH_STEPS = (1, 2, 3)


def _vector_value(rank: int, step: int, name: str) -> float:
    return 10.0 * step + rank + VECTOR.index(name) / 4


def _timer_lanes(rank: int, step: int) -> tuple:
    """(high, low) of the minmax vector's w/x and w/y on ``rank`` (rank 1 sends w/y/max too while
    the clash lasts: what w/y writes)."""
    return ([step * [3, 9, 1, 5][rank], step * (rank + 1)], [step * [2, 4, -6, 0][rank], -step * (rank + 1)])


def _scenarios(rank: int, world: int, host_packs: bool = True) -> dict:
    import torch

    from distmetrics.reduce import Reducer, Sample

    Reducer.host_packs = host_packs  # this rank's process only: every pack as a list, or as tensors
    out = {}
    # 1. one of each kind; values known per rank.
    r = Reducer()
    samples = [
        Sample("s", float(rank + 1), "sum"),
        Sample("m", torch.tensor(10.0 * rank), "mean", weight=rank + 1),
        Sample("hi", float([3, 9, 1, 9][rank]), "max"),
        Sample("lo", float([3, -2, 5, 7][rank]), "min"),
        Sample("mm", float([4, 8, -6, 0][rank]), "minmax"),
        Sample("every", 1.5 * rank, "all"),
    ]
    res = r.reduce(samples)
    out["kinds"] = (res.values, res.maxima, res.minima, {k: list(v) for k, v in res.per_rank.items()})
    out["first_collectives"] = r.collectives
    before = r.collectives
    r.reduce(samples)
    out["steady_collectives"] = r.collectives - before
    out["negotiations_after_two"] = r.negotiations

    # 2. ranks hold different names: rank 2 alone has "only2"; rank 0 lacks "m"; later a new name.
    r2 = Reducer()
    mine = [Sample("shared", 1.0, "sum"), Sample("w", float(rank), "mean", weight=0.0 if rank == 3 else 1.0)]
    if rank == 2:
        mine.append(Sample("only2", 42.0, "max"))
    if rank != 0:
        mine.append(Sample("m", float(rank), "mean"))
        mine.append(Sample("g", float(rank), "all"))
    res2 = r2.reduce(mine)
    out["union"] = (res2.values, res2.maxima, {k: list(v) for k, v in res2.per_rank.items()})
    before = r2.collectives
    if rank == 1:
        mine.append(Sample("late", -5.0, "min"))
    res3 = r2.reduce(mine)
    out["late"] = (res3.minima.get("late"), res3.values["shared"], r2.collectives - before, r2.negotiations)
    # 3. a name that disappears everywhere is simply absent, without renegotiating.
    before = r2.collectives
    res4 = r2.reduce([s for s in mine if s.name != "only2"])
    out["dropped"] = ("only2" in res4.maxima, r2.collectives - before)

    # 4. NaN on one rank wins both extremes; the rank is reported.
    r3 = Reducer()
    res = r3.reduce([Sample("n", math.nan if rank == 3 else float(rank), "minmax")])
    out["nan"] = (res.maxima["n"], res.minima["n"])

    # 5b. ranks out of step raise on every rank instead of mixing steps.
    r5 = Reducer()
    r5.reduce([Sample("x", 1.0, "sum")], tag=10)
    try:
        r5.reduce([Sample("x", 1.0, "sum")], tag=20 if rank == 2 else 30)
        out["out_of_step"] = None
    except RuntimeError as err:
        out["out_of_step"] = str(err)

    # 6. vectors (one name per element) give what the same values as scalars give; ranks 0/1
    # and 2/3 hold different element names.
    names = ("v/a", "v/b", "v/c") if rank < 2 else ("v/b", "v/d")
    values = torch.tensor([10.0 * rank + i for i in range(len(names))], dtype=torch.float64)
    weights = torch.tensor([1.0 + rank + i for i in range(len(names))], dtype=torch.float64)
    vector, scalar = {}, {}
    for kind in ("sum", "mean", "max", "min", "minmax", "all"):
        low = values - 100.0 if kind == "minmax" else None
        mean = kind == "mean"  # a weight is a mean's (another kind refuses one)
        vec = [Sample(kind, values, kind, weight=weights if mean else 1.0, low=low,
                      names=tuple(f"{kind}/{n}" for n in names))]
        sca = [Sample(f"{kind}/{n}", values[i], kind, weight=weights[i] if mean else 1.0,
                      low=None if low is None else low[i]) for i, n in enumerate(names)]
        for store, samples in ((vector, vec), (scalar, sca)):
            res = Reducer().reduce(samples)
            store[kind] = {k: list(v) if isinstance(v, list) else v for k, v in res.to_metrics().items()}
    out["vector"], out["scalar"] = vector, scalar

    # 7. a sum nobody sent this time is absent (not 0).
    r6 = Reducer()
    r6.reduce([Sample("gone", 1.0, "sum"), Sample("here", 1.0, "sum")])
    out["absent_sum"] = r6.reduce([Sample("here", 1.0, "sum")]).values

    # 8. negotiation bytes grow with the number of distinct name sets, not with the world.
    received = {}
    for distinct in (1, 2, 4):
        set_id = rank % distinct
        samples = [Sample(f"layer{set_id}/module{i:04d}", 1.0, "sum") for i in range(200)]
        r7 = Reducer()
        r7.reduce(samples)
        received[distinct] = r7.negotiation_bytes
    out["negotiation_bytes"] = received

    # 4b. a mean whose weight is 0 on a rank is no value there: its NaN or Inf counts for nothing.
    rz = Reducer()
    res = rz.reduce([Sample("z", math.nan if rank == 3 else float(rank), "mean", weight=0.0 if rank == 3 else 1.0),
                     Sample("zt", torch.tensor(math.inf if rank == 3 else float(rank)), "mean",
                            weight=torch.tensor(0.0 if rank == 3 else 2.0)),
                     Sample("zv", torch.tensor([1.0, math.nan if rank == 3 else 2.0]), "mean",
                            weight=torch.tensor([1.0, 0.0 if rank == 3 else 1.0]), names=("zv/a", "zv/b"))])
    out["weight0"] = (res.values["z"], res.values["zt"], res.values["zv/a"], res.values.get("zv/b"))
    # the summed form (value = Σ value·weight already): rank 3's NaN or Inf of weight 0 counts for nothing too
    bad = math.nan if rank == 3 else float(rank)
    rs = Reducer()
    res = rs.reduce([Sample("zs", bad, "mean", weight=0.0 if rank == 3 else 1.0, summed=True),
                     Sample("zst", torch.tensor(math.inf if rank == 3 else 2.0 * rank), "mean",
                            weight=torch.tensor(0.0 if rank == 3 else 2.0), summed=True),
                     Sample("zsv", torch.tensor([bad, 1.0]), "mean", weight=torch.tensor([0.0 if rank == 3 else 1.0, 1.0]),
                            summed=True, names=("zsv/a", "zsv/b"))])
    out["summed_weight0"] = (res.values["zs"], res.values["zst"], res.values["zsv/a"], res.values["zsv/b"])

    # 5. conflicting kinds across ranks: the name is left out on every rank, nobody hangs, and the
    # reducer holds the error its caller raises once the rest is written
    r4 = Reducer()
    res = r4.reduce([Sample("c", 1.0, "sum" if rank == 0 else "mean"), Sample("d", float(rank), "sum")])
    out["conflict"] = str(r4.refused) if r4.refused is not None else None
    out["conflict_rest"] = dict(res.values)
    # ... and once the ranks agree (ranks 1-3 now send the kind rank 0 sent), the name is reduced: no
    # kind was agreed for it, so neither rank's own check holds the one it sent then against it
    r4.refused = None
    try:
        res = r4.reduce([Sample("c", 1.0, "sum"), Sample("d", float(rank), "sum")], tag=2)
        out["conflict_over"] = (dict(res.values), None if r4.refused is None else str(r4.refused))
    except ValueError as err:
        out["conflict_over"] = str(err)

    # 9. a refused element of a vector sample: the vector's other elements are written, a clash that
    # lasts is not negotiated again at each log step, and once it ends the names are negotiated again.
    r8 = Reducer()
    mine = tuple(n for n in VECTOR if n != "v/b" or rank != 3)
    steps = []
    for step in (*CLASH_STEPS, 4):
        high, low = _timer_lanes(rank, step)
        samples = [Sample("v", torch.tensor([_vector_value(rank, step, n) for n in mine], dtype=torch.float64),
                          "mean", weight=float(rank + 1), names=mine),
                   Sample("w", torch.tensor(high, dtype=torch.float64), "minmax", low=torch.tensor(low),
                          names=("w/x", "w/y")),
                   Sample("ok", 1.0, "sum")]
        if step in CLASH_STEPS and rank == 3:
            samples.append(Sample("v/b", 7.0, "sum"))  # the vector's v/b elsewhere is a mean
        if step in CLASH_STEPS and rank == 1:
            samples.append(Sample("w/y/max", 7.0, "mean"))  # a key the minmax w/y writes
        collectives, negotiations = r8.collectives, r8.negotiations
        metrics = r8.reduce(samples, tag=step).to_metrics()
        steps.append((metrics, None if r8.refused is None else str(r8.refused), r8.collectives - collectives,
                      r8.negotiations - negotiations))
        r8.refused = None  # the caller takes the error, as the Monitor does
    out["refused_element"] = steps

    # 10. name sets that take turns between log steps (three sets, one rank with a name of its own in
    # one of them) settle on their union; a name gone for good leaves after KEPT_NEGOTIATIONS more.
    from distmetrics.reduce import KEPT_NEGOTIATIONS

    r9 = Reducer()
    turns = []
    for step in range(1, 13):
        turn = "abc"[step % 3]
        samples = [Sample(f"{turn}/x", float(rank + step), "sum"), Sample("all_steps", 1.0, "sum"),
                   Sample(turn, torch.tensor([rank * 1.0, -step * 1.0]), "max", names=(f"{turn}/p", f"{turn}/q"))]
        if turn == "b" and rank == 2:
            samples.append(Sample("b/only2", float(step), "mean"))
        negotiations = r9.negotiations
        metrics = r9.reduce(samples, tag=step).to_metrics()
        turns.append((metrics, r9.negotiations - negotiations))
    kept = []
    for step in range(13, 13 + KEPT_NEGOTIATIONS + 2):  # a new name at each: a negotiation at each
        r9.reduce([Sample(f"new{step}", 1.0, "sum")], tag=step)
        kept.append(sorted(name for name in r9._layout.kinds if not name.startswith("new")))
    out["turns"], out["kept"] = turns, kept

    # 11. an 'all' name sent once: its all-gather is made for KEPT_NEGOTIATIONS log steps more, not for ever
    r10 = Reducer()
    once = []
    for step in range(1, 10):
        samples = [Sample("s", 1.0, "sum")] + ([Sample("once", float(rank), "all")] if step in (1, 8) else [])
        collectives = r10.collectives
        metrics = r10.reduce(samples, tag=step).to_metrics()
        once.append((metrics.get("once"), r10.collectives - collectives))
    out["once"] = once
    # ...but one 'all' name sent now and then beside another sent at every step stays: no negotiation again
    r11 = Reducer()
    for step in range(1, 13):
        r11.reduce([Sample("every", 1.0, "all")] + ([Sample("sometimes", 2.0, "all")] if step % 6 == 1 else []),
                   tag=step)
    out["sometimes"] = r11.negotiations
    return out


@pytest.fixture(scope="module", params=[True, False], ids=["host packs", "tensor packs"])
def results(request):
    return run_ranks(_scenarios, WORLD, request.param)


def test_each_reduce_kind_matches_hand_computed_values(results):
    values, maxima, minima, per_rank = results[0]["kinds"]
    assert values["s"] == 1 + 2 + 3 + 4
    # mean weighted by rank+1: Σ 10r(r+1) / Σ (r+1)
    assert values["m"] == pytest.approx(sum(10 * r * (r + 1) for r in range(4)) / sum(r + 1 for r in range(4)))
    assert maxima["hi"] == (9.0, 1)  # tie between ranks 1 and 3: the lowest rank is named
    assert minima["lo"] == (-2.0, 1)
    assert maxima["mm"] == (8.0, 1) and minima["mm"] == (-6.0, 2)
    assert per_rank["every"] == [0.0, 1.5, 3.0, 4.5]


def test_every_rank_gets_the_same_result(results):
    assert all(r["kinds"] == results[0]["kinds"] for r in results)


def test_steady_state_issues_one_collective_per_kind(results):
    # MAX pack (max/min/minmax + control lanes), SUM pack (sum/mean), ALL gather: three kinds.
    assert results[0]["steady_collectives"] == 3
    # the first reduction adds one negotiation: a gather of digests, one broadcast of the one
    # name set every rank holds
    assert results[0]["first_collectives"] == 3 + 2
    assert results[0]["negotiations_after_two"] == 1


def test_ranks_with_different_names_get_the_union_without_mixing(results):
    values, maxima, per_rank = results[0]["union"]
    assert values["shared"] == 4.0
    assert values["w"] == pytest.approx((0 + 1 + 2) / 3)  # rank 3 has weight 0
    assert values["m"] == pytest.approx((1 + 2 + 3) / 3)  # rank 0 has no "m"
    assert maxima["only2"] == (42.0, 2)
    assert per_rank["g"] == [None, 1.0, 2.0, 3.0]


def test_a_new_name_on_one_rank_renegotiates_once(results):
    late_min, shared, collectives, negotiations = results[0]["late"]
    assert late_min == (-5.0, 1)
    assert shared == 4.0
    # MAX pack raises the flag → negotiation (digest gather + one broadcast per distinct name
    # set: the 4 ranks hold 4 different sets) → MAX again → SUM → ALL
    assert collectives == 1 + (1 + 4) + 3 and negotiations == 2


def test_a_name_gone_everywhere_is_absent_without_renegotiation(results):
    present, collectives = results[0]["dropped"]
    assert not present and collectives == 3


def test_vector_samples_reduce_like_the_same_values_as_scalars(results):
    for r in results:
        assert r["vector"] == r["scalar"]
    vector = results[0]["vector"]
    assert vector["sum"]["sum/v/b"] == 1 + 11 + 20 + 30  # element 1 on ranks 0/1, element 0 on 2/3
    assert vector["max"]["max/v/d"] == 31.0 and vector["max"]["max/v/d/max_rank"] == 3
    assert vector["all"]["all/v/a"] == [0.0, 10.0, None, None]


def test_a_sum_no_rank_sent_is_absent_not_zero(results):
    assert results[0]["absent_sum"] == {"here": 4.0}


def test_negotiation_bytes_grow_with_distinct_name_sets_not_world_size(results):
    received = results[0]["negotiation_bytes"]
    head = 4 * 16  # every rank's digest and payload size
    one_set = received[1] - head
    assert one_set > 0
    assert received[2] - head == pytest.approx(2 * one_set, rel=0.01)
    assert received[4] - head == pytest.approx(4 * one_set, rel=0.01)
    for r in results:
        assert r["negotiation_bytes"] == received


def test_nan_on_one_rank_is_never_hidden(results):
    (high, high_rank), (low, low_rank) = results[0]["nan"]
    assert math.isnan(high) and math.isnan(low) and high_rank == 3 and low_rank == 3


def test_a_nan_of_weight_0_does_not_make_the_mean_nan(results):
    # (0 + 1 + 2) / 3, (0 + 2 + 4) / 6; a vector's element of weight 0 on rank 3 likewise
    assert results[0]["weight0"] == (pytest.approx(1.0), pytest.approx(1.0), 1.0, 2.0)


def test_a_summed_mean_of_weight_0_does_not_make_the_mean_nan(results):
    """A summed sample's value of weight 0 went into the mean unmasked: NaN or Inf on every rank."""
    # Σ(value·weight) / Σ weight: (0 + 1 + 2) / 3; (0 + 2 + 4) / 6; vector: (0 + 1 + 2) / 3, (1 + 1 + 1 + 1) / 4
    assert results[0]["summed_weight0"] == (pytest.approx(1.0),) * 4


def test_conflicting_kinds_raise_on_every_rank(results):
    for r in results:
        assert r["conflict"] is not None and "'c'" in r["conflict"] and "same reduce kind" in r["conflict"]
        assert r["conflict_rest"] == {"d": 0 + 1 + 2 + 3}  # the rest is reduced
        assert r["conflict_over"] == ({"c": 4.0, "d": 6.0}, None), r["conflict_over"]


def test_a_refused_element_of_a_vector_leaves_out_only_itself_and_a_lasting_clash_is_not_negotiated_again(results):
    """One refused name (another kind on one rank; a key another name writes) dropped the whole vector
    sample it was in, and the names were negotiated again at every log step while the clash lasted."""
    def mean(step: int, name: str, ranks: range) -> float:
        return sum((r + 1) * _vector_value(r, step, name) for r in ranks) / sum(r + 1 for r in ranks)

    for r in results:
        for step, (metrics, refused, collectives, negotiations) in zip((*CLASH_STEPS, 4), r["refused_element"]):
            high, low = zip(*(_timer_lanes(rank, step) for rank in range(WORLD)))
            x_high, x_low = [h[0] for h in high], [lo[0] for lo in low]
            assert metrics["v/a"] == pytest.approx(mean(step, "v/a", range(WORLD)))
            assert metrics["v/c"] == pytest.approx(mean(step, "v/c", range(WORLD)))
            assert (metrics["w/x/max"], metrics["w/x/max_rank"]) == (max(x_high), x_high.index(max(x_high)))
            assert (metrics["w/x/min"], metrics["w/x/min_rank"]) == (min(x_low), x_low.index(min(x_low)))
            assert metrics["ok"] == WORLD
            if step in CLASH_STEPS:  # v/b, w/y and w/y/max left out; the error at every log step
                assert not [key for key in metrics if key.startswith(("v/b", "w/y"))], metrics
                assert "metric 'v/b' is reduced as 'mean' on rank 0 and 'sum' on rank 3;" in refused, refused
                assert "'w/y/max'" in refused and refused.endswith("(left out of this record)"), refused
                # step 1: digest gather + a broadcast for each of 3 distinct name sets, MAX, SUM; then MAX, SUM
                assert (collectives, negotiations) == ((1 + 3 + 2, 1) if step == 1 else (2, 0)), step
            else:  # the clash is over: flagged in the MAX pack, negotiated once, every name written
                assert refused is None and (collectives, negotiations) == (1 + (1 + 2) + 2, 1)
                assert metrics["v/b"] == pytest.approx(mean(step, "v/b", range(3)))
                y_high = [h[1] for h in high]
                assert (metrics["w/y/max"], metrics["w/y/max_rank"]) == (max(y_high), WORLD - 1)


def test_name_sets_that_take_turns_settle_on_their_union_and_a_name_gone_for_good_leaves(results):
    """Each negotiation's layout held only the names sent at it: sets that take turns between log
    steps negotiated again at every log step, for the whole run."""
    from distmetrics.reduce import KEPT_NEGOTIATIONS

    for r in results:
        for step, (metrics, negotiations) in enumerate(r["turns"], start=1):
            turn = "abc"[step % 3]
            assert negotiations == (1 if step <= 3 else 0), (step, negotiations)
            expected = {f"{turn}/x": sum(rank + step for rank in range(WORLD)), "all_steps": WORLD,
                        f"{turn}/p": WORLD - 1, f"{turn}/p/max_rank": WORLD - 1,
                        f"{turn}/q": -step, f"{turn}/q/max_rank": 0}
            if turn == "b":
                expected["b/only2"] = step
            assert metrics == expected, (step, metrics)
        every = ["all_steps", *(f"{t}/{n}" for t in "abc" for n in "pqx"), "b/only2"]
        assert r["kept"][0] == sorted(every)
        # sent no more: kept through at most KEPT_NEGOTIATIONS negotiations in a row at which no rank sent
        # it, all_steps (sent at every negotiation before) through exactly that many; "a" was sent at
        # the last negotiation of the turns (step 3), "c" at the one before, "b" two before
        assert all("all_steps" in names and "a/x" in names for names in r["kept"][:KEPT_NEGOTIATIONS])
        assert "b/x" not in r["kept"][KEPT_NEGOTIATIONS - 2] and "c/x" in r["kept"][KEPT_NEGOTIATIONS - 2]
        assert r["kept"][KEPT_NEGOTIATIONS] == []


def test_an_all_name_no_rank_sends_leaves_the_layout_and_its_gather_is_not_made(results):
    """An 'all' name sent once kept its all-gather (a collective of its own) at every log step after it; one
    that comes now and then beside others in the gather stays (dropped, it was negotiated again each time)."""
    for r in results:
        values, collectives = zip(*r["once"])
        assert values == ([0.0, 1.0, 2.0, 3.0], None, None, None, None, None, None, [0.0, 1.0, 2.0, 3.0], None)
        # step 1: negotiation (gather + one broadcast: every rank holds the same names), MAX, SUM, ALL; then
        # MAX, SUM, ALL at the 4 log steps without it, MAX and SUM after; step 8: the MAX pack's flag, negotiated
        # again, MAX, SUM, ALL; step 9 (it is gone again) MAX, SUM, ALL
        assert collectives == (2 + 3, 3, 3, 3, 3, 2, 2, 1 + 2 + 3, 3), collectives
        assert r["sometimes"] == 1  # a name left out of the gather it rides saves no collective: kept


def test_ranks_out_of_step_raise_on_every_rank(results):
    for r in results:
        assert r["out_of_step"] is not None and "out of step" in r["out_of_step"], r["out_of_step"]
        assert "at step 20 on rank 2 and step 30 on ranks 0, 1, 3" in r["out_of_step"]


@pytest.mark.parametrize("host_packs", [True, False], ids=["host packs", "tensor packs"])
def test_single_process_reduction_needs_no_process_group(host_packs, monkeypatch):
    import torch

    from distmetrics.reduce import Reducer, Sample

    monkeypatch.setattr(Reducer, "host_packs", host_packs)
    vector = Reducer().reduce([Sample("v", torch.tensor([1.0, 2.0, 3.0]), "mean", weight=torch.tensor([1.0, 0.0, 2.0]),
                                      names=("v/a", "v/b", "v/c")),
                               Sample("w", torch.tensor([4.0, 5.0]), "all", names=("w/a", "w/b"))])
    assert vector.values == {"v/a": 1.0, "v/c": 3.0} and list(vector.per_rank["w/b"]) == [5.0]
    counts = Reducer().reduce([Sample("c", torch.tensor([3, 2**53 + 1]), "sum", names=("c/a", "c/b")),
                               Sample("f", torch.tensor([True]), "all", names=("f/a",)),
                               Sample("m", 0.1, "mean", weight=torch.tensor(3.3))])
    weight = float(torch.tensor(3.3))  # float32's 3.3; the product is taken in float64 on both paths
    assert counts.values == {"c/a": 3.0, "c/b": float(2**53), "m": 0.1 * weight / weight}
    assert all(type(v) is float for v in [*counts.values.values(), *counts.per_rank["f/a"]])
    res = Reducer().reduce([Sample("a", torch.tensor(2.0), "mean", weight=3.0), Sample("b", 1.0, "minmax"),
                            Sample("c", 4.0, "all"), Sample("z", 5.0, "mean", weight=0.0)])
    assert res.values == {"a": 2.0}
    assert res.maxima["b"] == (1.0, 0) and res.minima["b"] == (1.0, 0)
    assert list(res.per_rank["c"]) == [4.0]


def test_unknown_reduce_kind_is_rejected():
    from distmetrics.reduce import Sample

    with pytest.raises(ValueError, match="reduce='median' is not one of sum, mean, max, min, minmax, all"):
        Sample("x", 1.0, "median")


@pytest.mark.parametrize("arguments,error,message", [
    (("x", None, "mean"), TypeError, "Sample 'x': expected a number or a 1-element tensor, got NoneType None"),
    (("x", None, "all"), TypeError, "Sample 'x': expected a number"),
    (("x", "1.0", "sum"), TypeError, "Sample 'x': expected a number or a 1-element tensor, got str '1.0'"),
    (("x", [1.0, 2.0], "max"), TypeError, "Sample 'x': expected a number"),
    (("x", "tensor2", "max"), ValueError, "Sample 'x': expected a number or a 1-element tensor, got a tensor of shape"),
    (("x", 1.0, "mean", None), TypeError, "Sample 'x' weight: expected a number"),
    (("x", 1.0, "minmax", 1.0, False, "low"), TypeError, "Sample 'x' low: expected a number"),
    (("x", 1.0, "min", 1.0, False, -10.0), ValueError, "Sample 'x': low is the min lane of a minmax, not used by 'min'"),
    ((7, 1.0, "mean"), TypeError, "a metric name is a str, got int 7"),
    (("x", 10**400, "max"), ValueError, "Sample 'x': 100000000000... \\(401 digits\\) is beyond float64's range"),
    (("x", 1.0, "mean", -10**400), ValueError, "Sample 'x' weight: -10000000000... \\(402 digits\\) is beyond"),
    (("x", 1.0, "mean", -2.0), ValueError,
     "Sample 'x' weight: -2.0 is refused: accepted values are finite numbers >= 0"),
    (("x", 1.0, "sum", 3.0), ValueError, "Sample 'x': a weight is a mean's; reduce='sum' would ignore weight=3.0"),
    (("x", 1.0, "max", "tensor2"), ValueError, "Sample 'x': a weight is a mean's; reduce='max' would ignore"),
])
def test_a_sample_with_a_value_no_pack_can_hold_is_refused_when_made(arguments, error, message):
    """A collector's bad value fails in its own take_samples, before the log step's first collective
    (a failure inside a pack would leave the other ranks waiting in the next collective)."""
    import torch

    from distmetrics.reduce import Sample

    import numpy as np

    arguments = tuple(torch.ones(2) if a == "tensor2" else a for a in arguments)
    with pytest.raises(error, match=message):
        Sample(*arguments)
    with pytest.raises(TypeError, match="vector sample 'v': element names are str"):
        Sample("v", torch.ones(2), "sum", names=("v/a", 2))
    for part in ("weight", "low"):  # one weight per name, or one for all: not a tensor of another length
        for wrong in (torch.ones(1), torch.tensor(2.0), torch.ones(3)):
            with pytest.raises(ValueError, match=f"vector sample 'v': {part} is a number or a 1-D tensor of 2"):
                Sample("v", torch.ones(2), "mean" if part == "weight" else "minmax", names=("v/a", "v/b"),
                       **{part: wrong})
        # a list or a numpy array passed here and failed in the pack, after the log step's first collective
        for wrong in ([1.0, 2.0], np.array([1.0, 2.0]), "1"):
            with pytest.raises(TypeError, match=f"vector sample 'v': {part} is a number or a 1-D tensor of 2 values"):
                Sample("v", torch.ones(2), "mean" if part == "weight" else "minmax", names=("v/a", "v/b"),
                       **{part: wrong})
    with pytest.raises(ValueError, match="vector sample 'v' weight: -1.0 is refused: accepted values are finite"):
        Sample("v", torch.ones(2), "mean", weight=-1.0, names=("v/a", "v/b"))


def test_a_name_twice_in_one_reduction_is_named_as_such_and_leaves_no_trace():
    from distmetrics.reduce import Reducer, Sample

    reducer = Reducer()
    with pytest.raises(ValueError, match="\\['x'\\] appear twice in one reduction"):
        reducer.reduce([Sample("x", 1.0, "mean"), Sample("x", 2.0, "max")])
    assert reducer.reduce([Sample("x", 2.0, "max")]).maxima == {"x": (2.0, 0)}  # 'x' was never reduced as mean


@pytest.mark.parametrize("host_packs", [True, False], ids=["host packs", "tensor packs"])
def test_scalars_of_every_kind_pack_once_and_their_index_is_reused(host_packs, monkeypatch):
    """Numbers and 0-d tensors of two dtypes (negated for the min lanes) land on their own lanes,
    the same at every log step; tensor packs build their index tensors once per layout, host
    packs the SUM pack's gather."""
    import torch

    from distmetrics.reduce import Reducer, Sample

    monkeypatch.setattr(Reducer, "host_packs", host_packs)

    def samples(k: float) -> list:
        return [Sample("a", torch.tensor(2.0 * k, dtype=torch.float32), "sum"), Sample("b", 3.0 * k, "sum"),
                Sample("c", torch.tensor(k, dtype=torch.float64), "minmax", low=torch.tensor(-k)),
                Sample("d", 1.5 * k, "min"), Sample("e", torch.tensor(7.0 * k), "max")]

    reducer = Reducer()
    first = reducer.reduce(samples(1.0))
    cached = dict(reducer._layout._indexes)
    second = reducer.reduce(samples(2.0))
    assert first.values == {"a": 2.0, "b": 3.0} and second.values == {"a": 4.0, "b": 6.0}
    assert second.maxima == {"c": (2.0, 0), "e": (14.0, 0)} and second.minima == {"c": (-2.0, 0), "d": (3.0, 0)}
    gathers = {key for key in cached if key[0] == "sum-gather"}  # host packs: the SUM pack's gather only
    assert bool(gathers) == host_packs and bool(cached.keys() - gathers) != host_packs
    assert reducer._layout._indexes.keys() == cached.keys()
    exact = Reducer().reduce([Sample("n", torch.tensor(16777217), "sum"),
                              Sample("h", torch.tensor(0.5, dtype=torch.float16), "sum")])
    assert exact.values == {"n": 16777217.0, "h": 0.5}  # each value in the pack's dtype: no promotion to float16
    assert all(reducer._layout._indexes[key] is index for key, index in cached.items())


def test_keys_made_on_the_host_equal_the_tensor_keys_and_decode_alike():
    """A number's MAX-pack key from :func:`encode_key` (Python) is bit for bit the key
    :func:`encode_keys` makes from a tensor, and the host decoding of a few lanes gives what the
    tensor decoding gives: NaN, ±inf, -0.0, subnormals, values past float32's range, any rank."""
    import random

    import torch

    from distmetrics.maxkeys import INT64_MIN, _decode_keys, _decode_keys_on_host, encode_key, encode_keys

    rng = random.Random(0)
    values = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 1e39, -1e300, 1.0000001]
    values += [rng.uniform(-1e6, 1e6) for _ in range(200)] + [rng.gauss(0, 1e-30) for _ in range(50)]
    for rank in (0, 1, 4095, 2**31 - 1):
        tensor_keys = encode_keys(torch.tensor(values, dtype=torch.float64).to(torch.float32), rank).tolist()
        assert [encode_key(v, rank) for v in values] == tensor_keys
        lanes = tensor_keys + [INT64_MIN]
        host, device = _decode_keys_on_host(lanes), _decode_keys(torch.tensor(lanes, dtype=torch.int64))
        assert host[1:] == device[1:]
        assert [v if v == v else "nan" for v in host[0]] == [v if v == v else "nan" for v in device[0]]


def test_a_repeated_log_step_skips_the_name_checks_but_a_changed_one_is_checked_again():
    """The second reduction of the very same names passes without the per-name checks; any change
    (a name twice, another kind for the same names tuple, a non-Sample) is checked and refused."""
    import torch

    from distmetrics.reduce import Reducer, Sample

    names = ("v/a", "v/b")
    reducer = Reducer()
    full_checks = []
    check_all = reducer._check_all
    reducer._check_all = lambda samples: full_checks.append(1) or check_all(samples)
    fresh = [f"x/{step}"[:2] for step in (10, 11, 12)]  # a scalar's name built afresh at each log step
    assert fresh[0] == fresh[1] and fresh[0] is not fresh[1]
    for name in fresh:
        reducer.reduce([Sample(name, 1.0, "mean"), Sample("v", torch.tensor([1.0, 2.0]), "sum", names=names)])
    assert len(full_checks) == 1
    with pytest.raises(ValueError, match="appear twice in one reduction"):
        reducer.reduce([Sample("x", 1.0, "mean"), Sample("v", torch.tensor([1.0, 2.0]), "sum", names=names),
                        Sample("v/a", 3.0, "sum")])
    with pytest.raises(ValueError, match="reduced as 'sum' before and now as 'max'"):
        reducer.reduce([Sample("x", 1.0, "mean"), Sample("v", torch.tensor([1.0, 2.0]), "max", names=names)])
    with pytest.raises(TypeError, match="expected Sample"):
        reducer.reduce([Sample("x", 1.0, "mean"), ("v", 1.0)])
    assert reducer.reduce([Sample("x", 4.0, "mean"), Sample("v", torch.tensor([1.0, 2.0]), "sum",
                                                             names=names)]).values == {"x": 4.0, "v/a": 1.0, "v/b": 2.0}


def test_the_written_name_checks_of_a_negotiation_grow_with_its_names_not_their_square(monkeypatch):
    """Each 'all' name was matched against every name written before it, to find an 'x/rank<N>'
    beside an 'all' x: the first step of tensor statistics for a 100-layer model took 14.5 s on
    2 ranks. Each name is matched a few times (itself and the names it writes), and the clashes
    are found and named as before, both names of each."""
    from distmetrics import names
    from distmetrics.reduce import _written_clashes

    class CountedPattern:
        def __init__(self, pattern):
            self.pattern, self.matches = pattern, 0

        def match(self, text):
            self.matches += 1
            return self.pattern.match(text)

    rank = CountedPattern(names._RANK)
    monkeypatch.setattr(names, "_RANK", rank)
    union = {f"layer{i}/act": "all" for i in range(500)}
    assert _written_clashes(union) == {}
    assert rank.matches <= 10 * len(union)  # 5 each: the name and the 4 it writes (half a million before)
    clashes = _written_clashes({"x/rank0": "sum", **union, "x/rank1": "max", "x": "all"})
    assert set(clashes) == {"x", "x/rank0"} and clashes["x"] == clashes["x/rank0"] == (
        "metric 'x' from some rank (all): JSONL would write 'x''s ranks as 'x/rank0', which metric 'x/rank0' "
        "from some rank (sum) writes already")
    clashes = _written_clashes({"x": "all", **union, "x/rank3": "sum"})
    assert set(clashes) == {"x", "x/rank3"} and clashes["x/rank3"] == (
        "metric 'x/rank3' from some rank (sum) would write 'x/rank3', which JSONL uses for a rank of the 'all' "
        "metric 'x'")


def test_the_key_index_holds_every_key_to_metrics_writes_and_no_other():
    """``Reduced.keys_under`` (worked out once per layout) against what ``to_metrics`` writes
    when every name is present: the same keys, for every reduce kind, under any prefix."""
    import torch

    from distmetrics.reduce import Reducer, Sample

    samples = [Sample("a/s", 1.0, "sum"), Sample("a/m", 2.0, "mean"), Sample("b/x", 3.0, "max"),
               Sample("b/n", 4.0, "min"), Sample("b/mm", 5.0, "minmax"), Sample("c/all", 6.0, "all"),
               Sample("v", torch.tensor([1.0, 2.0]), "minmax", names=("v/0", "v/1"))]
    reduced = Reducer().reduce(samples)
    written = set(reduced.to_metrics())
    assert set(reduced.keys_under(("",))) == written
    for prefixes in (("a/",), ("b/", "v/"), ("c/all",), ("nothing/",)):
        assert set(reduced.keys_under(prefixes)) == {k for k in written if k.startswith(prefixes)}
    assert reduced.keys_under(("b/",)) is reduced.keys_under(("b/",))  # cached


@pytest.mark.parametrize("host_packs", [True, False], ids=["host packs", "tensor packs"])
def test_a_max_pack_of_more_lanes_than_the_host_decodes_reduces_like_a_small_one(host_packs, monkeypatch):
    """300 max names and a minmax vector (over 256 MAX lanes: the tensor decoding) against hand maxima."""
    import torch

    from distmetrics.maxkeys import HOST_DECODE_LANES
    from distmetrics.reduce import Reducer, Sample

    monkeypatch.setattr(Reducer, "host_packs", host_packs)
    samples = [Sample(f"m/{i:03d}", i * 0.5, "max") for i in range(300)]
    samples.append(Sample("v", torch.tensor([3.0, -2.0]), "minmax", low=torch.tensor([1.0, -4.0]),
                          names=("v/a", "v/b")))
    reducer = Reducer()
    result = reducer.reduce(samples)
    assert reducer._layout.n_max > HOST_DECODE_LANES
    assert all(result.maxima[f"m/{i:03d}"] == (i * 0.5, 0) for i in range(300))
    assert result.maxima["v/a"] == (3.0, 0) and result.minima["v/b"] == (-4.0, 0)


def test_scalars_on_a_device_are_stacked_in_the_packs_dtype(monkeypatch):
    """The path a GPU's 0-d tensors take (cast each to the pack's dtype, stack, move once), forced
    on CPU by treating every tensor as off the host: an int64 beyond float32's precision and a
    float16 next to each other keep their values."""
    import torch

    from distmetrics import packing, packs
    from distmetrics.reduce import Reducer, Sample

    def device_only(value):
        return None if isinstance(value, torch.Tensor) else float(value)

    for module in (packing, packs):
        monkeypatch.setattr(module, "host_number", device_only)
    monkeypatch.setattr(Reducer, "host_packs", False)
    calls = []
    stack = packing._stack
    monkeypatch.setattr(packing, "_stack", lambda *a: calls.append(1) or stack(*a))
    result = Reducer().reduce([Sample("n", torch.tensor(16777217), "sum"),
                               Sample("h", torch.tensor(0.5, dtype=torch.float16), "sum"),
                               Sample("c", torch.tensor(2.5, dtype=torch.float64), "minmax",
                                      low=torch.tensor(-1.5, dtype=torch.float16))])
    assert calls and result.values == {"n": 16777217.0, "h": 0.5}
    assert result.maxima["c"] == (2.5, 0) and result.minima["c"] == (-1.5, 0)


def test_a_bool_or_int_scalar_on_a_device_takes_a_min_as_on_the_host(monkeypatch):
    """A min lane is negated: on the device path a bool tensor cannot be, and an int 0 negated
    before its cast gave +0.0 where the host path gives -0.0 (then 0.0 as the min). The value is
    cast to the pack's dtype first; both paths agree."""
    import torch

    from distmetrics import packing, packs
    from distmetrics.reduce import Reducer, Sample

    samples = lambda: [Sample("flag", torch.tensor(True), "min"), Sample("zero", torch.tensor(0), "min"),  # noqa: E731
                       Sample("span", torch.tensor(3), "minmax", low=torch.tensor(False))]
    host = Reducer().reduce(samples()).to_metrics()

    def device_only(value):
        return None if isinstance(value, torch.Tensor) else float(value)

    for module in (packing, packs):
        monkeypatch.setattr(module, "host_number", device_only)
    monkeypatch.setattr(Reducer, "host_packs", False)
    device = Reducer().reduce(samples()).to_metrics()
    assert device == host == {"flag": 1.0, "flag/min_rank": 0, "zero": 0.0, "zero/min_rank": 0, "span/max": 3.0,
                              "span/max_rank": 0, "span/min": 0.0, "span/min_rank": 0}
    assert math.copysign(1.0, device["zero"]) == math.copysign(1.0, host["zero"])


def test_pack_positions_cached_by_a_tuples_identity_are_not_reused_for_another_tuple():
    """Vector positions and the SUM pack's gather are cached under the names tuple's id (no hash
    of every name at each log step). A tuple freed and another made at the same address must
    not take the old entry: entries for the same ids but other names are planted, and the
    values still land under their own names, as a fresh reducer puts them."""
    import torch

    from distmetrics.packing import PackLayout
    from distmetrics.packs import sum_lanes_on_host
    from distmetrics.reduce import Sample

    names = ("v/a", "v/b", "v/c")
    samples = [Sample("s", 5.0, "sum"), Sample("v", torch.tensor([1.0, 2.0, 3.0]), "sum", names=names)]
    layout = PackLayout([("s", "sum")] + [(name, "sum") for name in names])
    expected = sum_lanes_on_host(PackLayout(layout.entries), samples)
    assert expected == ((5.0, 1.0, 2.0, 3.0), (1.0, 1.0, 1.0, 1.0))  # s, v/a, v/b, v/c: values, weights
    other = ("v/c", "v/b", "v/a")  # the same names in another order: other positions
    layout.vector_base(other, "sum")
    layout._vectors[(id(names), "sum")] = layout._vectors[(id(other), "sum")]
    layout.cached_index(("sum-gather", ("s", id(names))), lambda: (["s", other], lambda lanes: lanes[::-1][1:]))
    assert layout.host_positions(names, "sum") == [2, 4, 6]
    assert sum_lanes_on_host(layout, samples) == expected


def test_a_packs_cached_index_is_not_taken_by_other_position_tensors_at_the_same_ids(monkeypatch):
    """The index of a pack's pieces is cached under the ids of their position tensors. An id can
    be reused by a new tensor once the old one is let go (the vector cache clears itself); here
    ``id`` in the packing module gives every tensor of a length the same number, as such reuse
    would. Pieces at other positions must not take the first pieces' index: each pack's index is
    that of its own pieces, as a fresh layout builds it."""
    import torch

    from distmetrics import packing
    from distmetrics.packing import PackLayout, Pieces

    monkeypatch.setattr(packing, "id", lambda obj: len(obj) if isinstance(obj, torch.Tensor) else id(obj),
                        raising=False)
    layout = PackLayout([(f"v/{i}", "sum") for i in range(6)])
    cpu = torch.device("cpu")
    for a, b in ((("v/0", "v/2", "v/4"), ("v/5", "v/3", "v/1")), (("v/1", "v/3", "v/5"), ("v/4", "v/2", "v/0"))):
        pieces = Pieces(layout, cpu, torch.float64)
        for names in (a, b):
            pieces.add_vector(layout.positions(names, "sum", 0, cpu), torch.ones(3, dtype=torch.float64))
        index, _ = pieces.assemble()
        assert index.tolist() == [layout.sum_index[name] for name in a + b]


# --- mostly means: decode_sum ----------------------------------------------------------------
# decode_sum's branch for SUM packs that are mostly means (every lane divided in one ``map``, a
# sum's divisor set to 1): a user's sum and mean names mixed, weighted means, a weight-0 entry and
# names absent on one rank, through monitor.record/step on 1 rank and on 2 gloo ranks, against
# float64 sums of what each rank recorded.

INTERVAL = 2


def _records(rank: int, step: int, world: int) -> list:
    """(name, value, reduce, weight) this rank records at ``step``: 3 sums (no weight: only a mean takes one),
    6 means."""
    out = [("u/s0", 0.1 * (rank + 1) * step, "sum", None),
           ("u/s1", 1.7 + rank - 0.3 * step, "sum", None),
           ("u/m0", 0.3 + rank + step, "mean", 1.0),
           ("u/m1", 2.5 * step - rank, "mean", 7.0 + rank + step),
           ("u/m2", 1.1 * step + 0.01 * rank, "mean", 0.25 * (rank + 1)),
           ("u/m4", 1e3 / (rank + step), "mean", 0.5)]
    # weight 0 ("this rank has none", its value NaN): on 1 rank at step 1, on 2 ranks all of rank 1's
    zero = rank == 1 or (world == 1 and step == 1)
    out.append(("u/m3", math.nan if zero else 4.4 + step + rank, "mean", 0.0 if zero else 2.0 + rank))
    if rank == 0:
        out.append(("u/s2", -3.3 + step, "sum", None))  # absent on rank 1
    if rank == world - 1:
        out.append(("u/m5", -0.7 * step, "mean", float(step)))  # absent on rank 0 of 2
    return out


def _loss(rank: int, step: int) -> tuple:
    return 2.0 + 0.1 * rank + 0.013 * step, 10 * (rank + 1) + step  # (loss, tokens)


def _expected(world: int) -> dict:
    """Σ value (sum), Σ value·weight / Σ weight over weight ≠ 0 (mean), in float64 by hand."""
    num: dict = {}
    den: dict = {}
    for rank in range(world):
        for step in range(1, INTERVAL + 1):
            loss, tokens = _loss(rank, step)
            for name, value, reduce, weight in _records(rank, step, world) + [("train/loss", loss, "mean", tokens)]:
                if reduce == "sum":
                    num[name] = num.get(name, 0.0) + value
                    den[name] = 1.0
                elif weight != 0:
                    num[name] = num.get(name, 0.0) + value * weight
                    den[name] = den.get(name, 0.0) + weight
    return {name: num[name] / den[name] for name in num}


def _run(rank: int, world: int) -> dict:
    import torch

    import distmetrics as dm
    import distmetrics.reduce as reduce_module

    real = reduce_module.decode_sum
    branches = []

    def spy(layout, totals, weights, result):  # only notes which branch the call takes, then calls it
        branches.append((len(layout.mean_lanes) > len(layout.sum_lanes), 0.0 in list(weights)))
        return real(layout, totals, weights, result)

    reduce_module.decode_sum = spy
    try:
        with dm.Monitor(quiet_config(log_interval=INTERVAL)) as monitor:
            for step in range(1, INTERVAL + 1):
                for i, (name, value, reduce, weight) in enumerate(_records(rank, step, world)):
                    if i % 2:  # half as 0-d float64 tensors
                        value = torch.tensor(value, dtype=torch.float64)
                        weight = None if weight is None else torch.tensor(weight)
                    monitor.record(name, value, reduce=reduce, weight=weight)
                loss, tokens = _loss(rank, step)
                metrics = monitor.step(step, loss=torch.tensor(loss, dtype=torch.float64), tokens=tokens)
    finally:
        reduce_module.decode_sum = real
    return {"metrics": {k: v for k, v in metrics.items() if k.startswith(("u/", "train/loss"))},
            "branches": branches}


def _check(out: dict, world: int) -> None:
    assert out["branches"] == [(True, False)]  # the mostly-means branch, no name of total weight 0
    expected = _expected(world)
    assert sorted(out["metrics"]) == sorted(expected)
    for name, value in expected.items():
        assert out["metrics"][name] == pytest.approx(value, rel=1e-12, abs=0), name


def test_mostly_means_one_rank():
    _check(_run(0, 1), 1)


def test_mostly_means_two_gloo_ranks():
    results = run_ranks(_run, 2)
    assert results[0]["metrics"] == results[1]["metrics"]  # the same dict on every rank
    _check(results[0], 2)


def test_an_all_summary_of_opposite_infinities_or_huge_values_is_nan_or_inf_not_an_error():
    """The summary's mean of +inf and -inf is NaN and of two 1e308 inf, as a plain sum gives (an
    exact fsum raised: the log step failed on every rank); a NaN on any rank makes each NaN."""
    from distmetrics.per_rank import PerRank
    from distmetrics.samples import _summary

    assert math.isnan(_summary(PerRank([math.inf, -math.inf]))["mean"])
    assert _summary(PerRank([1e308, 1e308])) == {"max": 1e308, "min": 1e308, "mean": math.inf}
    assert all(math.isnan(v) for v in _summary(PerRank([1.0, math.nan, None])).values())
    assert _summary(PerRank([None, 2.0, 4.0])) == {"max": 4.0, "min": 2.0, "mean": 3.0}


def test_name_sets_that_take_turns_in_one_process_keep_one_layout():
    """One process built a new layout at every log step where the names took turns."""
    from distmetrics.reduce import Reducer, Sample

    r = Reducer()
    layouts = []
    for step in range(1, 9):
        turn = "ab"[step % 2]
        result = r.reduce([Sample(f"{turn}/x", float(step), "sum"), Sample(f"{turn}/y", -float(step), "min")])
        assert result.to_metrics() == {f"{turn}/x": step, f"{turn}/y": -step, f"{turn}/y/min_rank": 0}
        layouts.append(r._layout)
    assert len(set(map(id, layouts[1:]))) == 1 and sorted(layouts[-1].kinds) == ["a/x", "a/y", "b/x", "b/y"]



class _UnreadableAtStep2:
    """A collector of the user's whose sample at step 2 holds a tensor the packs cannot read."""

    name, after, writes = "odd", (), ("m/",)

    def __init__(self, case: str) -> None:
        self.case = case

    def take_samples(self, ctx):
        import torch

        from distmetrics.reduce import Sample

        if ctx.step != 2:
            return [Sample("m/x", 1.0, "mean")]
        meta = torch.ones((), device="meta")
        return [{"value": Sample("m/x", meta, "mean"), "weight": Sample("m/x", 1.0, "mean", weight=meta),
                 "sparse vector": Sample("m/v", torch.ones(2).to_sparse(), "max", names=("m/v/a", "m/v/b"))}[self.case]]

    def finalize(self, metrics, ctx):
        return []

    def close(self):
        pass


@pytest.mark.parametrize("case,said", [
    ("value", "Sample 'm/x' value: a tensor on the meta device holds no value"),
    ("weight", "Sample 'm/x' weight: a tensor on the meta device holds no value"),
    ("sparse vector", "Sample 'm/v' value: expected a dense tensor, got a torch.sparse_coo one")])
def test_a_user_sample_holding_a_tensor_no_pack_can_read_fails_its_collector_before_any_collective(tmp_path, case,
                                                                                                   said):
    """A tensor on the meta device (or a sparse one) failed inside the packs with a bare NotImplementedError,
    after the log step's first collective (the other ranks waiting), and the record was lost. Refused in the
    collector's take_samples, as monitor.record refuses one: the record is written without it."""
    import distmetrics as dm

    config = quiet_config(log_interval=1, json_log=True, output_dir=str(tmp_path))
    with dm.Monitor(config, collectors=[_UnreadableAtStep2(case)]) as monitor:
        monitor.step(1, loss=1.0)
        with pytest.raises(dm.CollectorFailed, match=re.escape(said)):
            monitor.step(2, loss=2.0)
        monitor.step(3, loss=3.0)
    records = [r for r in dm.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["step"], r["train/loss"], r.get("m/x")) for r in records] == [(1, 1.0, 1.0), (2, 2.0, None),
                                                                              (3, 3.0, 1.0)], records
