"""Pipeline plans (funcpar/pipeline/schedule.py): stage assignment, the three schedules, validation and the simulation.

Pure Python, no processes: each test builds schedules as data and checks them.
"""

from __future__ import annotations

import pytest

from funcpar.pipeline.schedule import (
    Action,
    PipelineError,
    Schedule,
    assign_layers,
    assign_units,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    zero_bubble,
)

# (pp, n_micro) for pp in (1, 2, 4) and n_micro in (pp, 2 pp, 8), without repeats
GRID = sorted({(pp, n) for pp in (1, 2, 4) for n in (pp, 2 * pp, 8)})


def build(name: str, pp: int, n: int) -> Schedule:
    return make_schedule(name, pp, n, chunks=2 if name == "interleaved" else 1)


# ---- stage assignment ----------------------------------------------------------------------------------------------

def test_assign_layers_balanced_earlier_stages_take_the_extra_layer():
    stages = assign_layers(10, 4)
    assert [len(s) for s in stages] == [3, 3, 2, 2]
    assert [list(s) for s in stages] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert assign_layers(12, 4) == [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
    assert assign_layers(5, 1) == [range(0, 5)]
    assert assign_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]


def test_assign_layers_follows_parts():
    assert assign_layers(12, 3, parts=[2, 6, 4]) == [range(0, 2), range(2, 8), range(8, 12)]
    assert assign_layers(4, 2, parts=[1, 3]) == [range(0, 1), range(1, 4)]


@pytest.mark.parametrize("args, kwargs, message", [
    ((12, 3), {"parts": [5, 4, 4]}, r"parts \[5, 4, 4\] sum to 13 but the model has 12 layers"),
    ((3, 4), {}, r"4 pipeline stages but the model has only 3 layers: each stage needs at least one"),
    ((12, 4), {"parts": [4, 4, 4]}, r"parts has 3 entries for 4 stages"),
    ((12, 3), {"parts": [6, 0, 6]}, r"parts\[1\] is 0: stage 1 needs at least one layer"),
    ((12, 3), {"parts": [7, 6, -1]}, r"parts\[2\] is -1: stage 2 needs at least one layer"),
    ((12, 0), {}, r"at least 1 stage, got 0"),
])
def test_assign_layers_errors_name_the_numbers(args, kwargs, message):
    with pytest.raises(PipelineError, match=message):
        assign_layers(*args, **kwargs)


def test_assign_units_balances_costs_and_may_cut_a_layer_between_its_halves():
    # a small Llama's halves (attention 0.79, MLP 2.16; the last MLP carries the head's 2.1): whole layers split
    # 6.16 : 8.26 over two stages, a cut after layer 2's attention 7.08 : 7.34 (the cut nearest half the total)
    costs = [0.79, 2.16] * 4
    costs[-1] += 2.1
    assert assign_units(4, 2, costs, halves=True) == [range(0, 5), range(5, 8)]
    assert assign_units(4, 4, costs, halves=True) == [range(0, 3), range(3, 5), range(5, 7), range(7, 8)]
    # whole layers (no halves): the head's weight moves a layer off the last stage
    assert assign_units(8, 2, [1.0] * 7 + [5.0]) == [range(0, 6), range(6, 8)]
    # one unit of all the weight: every other stage keeps one unit, in order
    assert assign_units(4, 3, [0, 0, 0, 9.0]) == [range(0, 1), range(1, 2), range(2, 4)]
    # no costs, or none positive: the even split
    assert assign_units(10, 4) == assign_layers(10, 4)
    assert assign_units(3, 2, [0.0, 0.0, 0.0]) == assign_layers(3, 2)
    assert assign_units(2, 4, None, halves=True) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]


def test_assign_units_parts_count_layers_in_halves():
    assert assign_units(4, 2, parts=[2.5, 1.5], halves=True) == [range(0, 5), range(5, 8)]
    assert assign_units(4, 2, parts=[1, 3], halves=True) == [range(0, 2), range(2, 8)]
    assert assign_units(4, 2, parts=[1, 3]) == [range(0, 1), range(1, 4)]  # whole layers: parts as assign_layers
    import numpy as np  # numbers of any kind: numpy's too

    assert assign_units(4, 2, parts=list(np.array([2.5, 1.5])), halves=True) == [range(0, 5), range(5, 8)]
    assert assign_units(4, 2, parts=np.array([1, 3])) == [range(0, 1), range(1, 4)]


@pytest.mark.parametrize("args, kwargs, message", [
    ((4, 2), {"parts": [2.5, 1.5]}, r"parts\[0\] is 2.5: this model's stages hold whole layers"),
    ((4, 2), {"parts": [2.25, 1.75], "halves": True}, r"parts\[0\] is 2.25: a stage holds whole layers or halves"),
    ((4, 2), {"parts": [4, 0], "halves": True}, r"parts\[1\] is 0: stage 1 needs at least one layer or half of one"),
    ((4, 2), {"parts": [2.5, 2], "halves": True}, r"parts \[2.5, 2\] sum to 4.5 but the model has 4 layers"),
    ((4, 2), {"parts": [1, 1, 2], "halves": True}, r"parts has 3 entries for 2 stages"),
    ((2, 5), {"halves": True}, r"5 pipeline stages but the model has only 2 layers \(4 halves\): each stage needs "
                               r"at least one half"),
    ((2, 3), {}, r"3 pipeline stages but the model has only 2 layers: each stage needs at least one$"),
    ((2, 0), {"halves": True}, r"at least 1 stage, got 0"),
])
def test_assign_units_errors_name_the_numbers(args, kwargs, message):
    with pytest.raises(PipelineError, match=message):
        assign_units(*args, **kwargs)


def test_virtual_stage_c_pp_plus_r_is_on_rank_r():
    sched = interleaved_1f1b(2, 4, chunks=2)
    assert [[sched.stage_of(r, c) for c in range(2)] for r in range(2)] == [[0, 2], [1, 3]]
    assert [one_f_one_b(2, 2).stage_of(r, 0) for r in range(2)] == [0, 1]


# ---- the schedules -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize("pp, n", GRID)
def test_every_schedule_validates_and_simulates(name, pp, n):
    sched = build(name, pp, n)
    assert sched.validate() is sched
    assert (sched.name, sched.pp, sched.n_micro) == (name, pp, n)
    assert all(len(acts) == 2 * n * sched.chunks for acts in sched.actions)
    sim = sched.simulate()
    # every rank is busy n_micro * chunks * (t_forward + t_backward), and nothing runs in parallel on a rank
    assert sim["busy"] == [n * sched.chunks * 3.0] * pp
    assert sim["makespan"] >= sim["busy"][0]
    assert 0.0 <= sim["bubble"] < 1.0


@pytest.mark.parametrize("pp, n", GRID + [(4, 2), (4, 3)])
def test_1f1b_keeps_at_most_pp_micro_batches_in_flight(pp, n):
    in_flight = one_f_one_b(pp, n).simulate()["max_in_flight"]
    assert all(k <= pp for k in in_flight)
    assert in_flight[0] == min(pp, n)
    assert in_flight == [min(pp - r, n) for r in range(pp)]


@pytest.mark.parametrize("pp, n", GRID)
def test_gpipe_holds_every_micro_batch(pp, n):
    assert gpipe(pp, n).simulate()["max_in_flight"] == [n] * pp


@pytest.mark.parametrize("pp, n", GRID)
def test_interleaved_rank0_holds_pp_micro_batches_worth_of_layers(pp, n):
    # chunks * pp chunk activations of 1 / chunks of the rank's layers each: the memory of 1F1B's rank 0
    in_flight = interleaved_1f1b(pp, n, chunks=2).simulate()["max_in_flight"]
    assert in_flight[0] == 2 * pp
    assert max(in_flight) == in_flight[0]


@pytest.mark.parametrize("pp, n", [(4, 8), (2, 4), (4, 4), (4, 16)])
def test_bubbles(pp, n):
    g = gpipe(pp, n).simulate()["bubble"]
    one = one_f_one_b(pp, n).simulate()["bubble"]
    inter = interleaved_1f1b(pp, n, chunks=2).simulate()["bubble"]
    # With every forward taking the same time (and every backward too), 1F1B fills and drains the pipeline exactly
    # as GPipe does: the same bubble, (pp - 1) / (n + pp - 1). 1F1B's gain is memory, not time.
    assert g == pytest.approx((pp - 1) / (n + pp - 1))
    assert one == pytest.approx(g)
    # Interleaving with 2 chunks halves the fill and drain: (pp - 1) / (2 n + pp - 1), strictly below 1F1B.
    assert inter == pytest.approx((pp - 1) / (2 * n + pp - 1))
    assert inter < one - 0.05


def test_interleaved_beats_1f1b_with_uneven_times_too():
    for t_forward, t_backward in [(1.0, 1.0), (2.0, 1.0), (1.0, 3.0)]:
        one = one_f_one_b(4, 8).simulate(t_forward, t_backward)["bubble"]
        inter = interleaved_1f1b(4, 8, chunks=3).simulate(t_forward, t_backward)["bubble"]
        assert inter < one


def test_1f1b_order_on_each_rank():
    sched = one_f_one_b(4, 6)
    labels = [[a.label() for a in acts] for acts in sched.actions]
    assert labels[0] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split()
    assert labels[3] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5".split()


def test_gpipe_runs_backwards_in_micro_batch_order():
    assert [a.label() for a in gpipe(2, 3).actions[1]] == "F0 F1 F2 B0 B1 B2".split()


def test_interleaved_goes_round_in_groups_of_pp():
    fwd = [a.label(2) for a in interleaved_1f1b(2, 4, chunks=2).actions[0] if a.kind == "F"]
    assert fwd == "F0c0 F1c0 F0c1 F1c1 F2c0 F3c0 F2c1 F3c1".split()


@pytest.mark.parametrize("call, message", [
    (lambda: interleaved_1f1b(4, 6, chunks=2), r"n_micro=6 is not a multiple of pp=4"),
    (lambda: interleaved_1f1b(4, 8, chunks=1), r"chunks=1, needs at least 2"),
    (lambda: make_schedule("zbv", 2, 4), r"unknown pipeline schedule 'zbv'; known: gpipe, 1f1b, interleaved, zb"),
    (lambda: make_schedule("1f1b", 2, 4, chunks=2), r"1f1b runs one chunk per rank, got chunks=2 \(use "
                                                    r"'interleaved' or 'zb'\)"),
    (lambda: zero_bubble(4, 6, chunks=2), r"zb: n_micro=6 is not a multiple of pp=4 \(with chunks=2"),
    (lambda: zero_bubble(2, 0), r"zb: n_micro must be a positive integer, got 0"),
    (lambda: one_f_one_b(0, 4), r"pp must be a positive integer, got 0"),
    (lambda: gpipe(2, 0), r"n_micro must be a positive integer, got 0"),
])
def test_builder_errors(call, message):
    with pytest.raises(PipelineError, match=message):
        call()


# ---- checking and simulating ---------------------------------------------------------------------------------------

def plan(pp: int, n: int, *ranks: str) -> Schedule:
    """A hand-built one-chunk schedule from strings such as "F0 F1 B0 B1"."""
    acts = tuple(tuple(Action(w[0], int(w[1:])) for w in r.split()) for r in ranks)
    return Schedule("hand", pp, n, 1, acts)


def test_validate_rejects_a_backward_before_its_forward():
    bad = plan(2, 2, "F0 F1 B0 B1", "F0 B1 F1 B0")
    with pytest.raises(PipelineError, match=r"rank 1, action 1 \(B1: micro-batch 1, virtual stage 1\) comes before "
                                            r"its forward F1"):
        bad.validate()
    with pytest.raises(PipelineError, match=r"rank 1, action 1"):
        bad.simulate()  # simulate validates first


@pytest.mark.parametrize("ranks, message", [
    (("F0 F1 B0 B1", "F0 F1 B0"), r"rank 1 never runs B1 \(micro-batch 1, virtual stage 1\)"),
    (("F0 F0 B0 B1", "F0 F1 B0 B1"), r"rank 0, action 1 \(F0: .*\) runs twice \(first as action 0\)"),
    (("F0 F1 B0 B1 F2", "F0 F1 B0 B1"), r"rank 0, action 4 \(F2: .*\) is not an action of this schedule"),
    (("F0 F1 B0 B1",), r"1 action list for pp=2"),
])
def test_validate_names_what_is_wrong(ranks, message):
    with pytest.raises(PipelineError, match=message):
        plan(2, 2, *ranks).validate()


def test_simulate_reports_a_deadlock_naming_each_rank():
    # valid on each rank, but rank 0 wants B0 back before sending F1, and rank 1 wants F1 before running B0
    stuck = plan(2, 2, "F0 B0 F1 B1", "F1 B1 F0 B0").validate()
    with pytest.raises(PipelineError, match=r"deadlock") as info:
        stuck.simulate()
    assert "rank 0 waits at B0 (action 1) for B0 on rank 1" in str(info.value)
    assert "rank 1 waits at F1 (action 0) for F1 on rank 0" in str(info.value)


def test_simulate_times_follow_the_dependencies():
    sim = one_f_one_b(2, 2).simulate(t_forward=1.0, t_backward=2.0)
    spans = [[(s, e, a.label()) for s, e, a in r] for r in sim["spans"]]
    assert spans[0] == [(0, 1, "F0"), (1, 2, "F1"), (4, 6, "B0"), (7, 9, "B1")]
    assert spans[1] == [(1, 2, "F0"), (2, 4, "B0"), (4, 5, "F1"), (5, 7, "B1")]
    assert sim["makespan"] == 9 and sim["busy"] == [6, 6]
    assert sim["bubble"] == pytest.approx(1 - 12 / 18)


# ---- zero bubble: backwards split into B (the input's gradient) and W (the weights') ------------------------------

@pytest.mark.parametrize("pp, n, chunks", [(pp, n, 1) for pp, n in GRID] + [(2, 4, 2), (2, 8, 2), (4, 8, 2), (4, 8, 3)])
def test_zero_bubble_keeps_the_plain_orders_and_beats_them(pp, n, chunks):
    zb = zero_bubble(pp, n, chunks).validate()
    base = one_f_one_b(pp, n) if chunks == 1 else interleaved_1f1b(pp, n, chunks)
    for r, acts in enumerate(zb.actions):
        # every backward split, its W after its B; forwards and backwards each in the plain schedule's order, so
        # every rank posts its sends and receives in the same order (a backend that pairs them by order pairs them)
        assert {a for a in acts if a.kind == "W"} == {Action("W", a.micro, a.chunk) for a in acts if a.kind == "B"}
        for kind in "FB":
            assert [a for a in acts if a.kind == kind] == [a for a in base.actions[r] if a.kind == kind]
    assert zb.split() == {(r, a.micro, a.chunk) for r in range(pp) for a in zb.actions[r] if a.kind == "B"}
    # held until W: at most one chunk activation more than the plain schedule holds until B
    got, plain = zb.simulate()["max_in_flight"], base.simulate()["max_in_flight"]
    assert all(g <= p + 1 for g, p in zip(got, plain, strict=True)), (got, plain)
    fast, slow = zb.simulate(1, 2)["makespan"], base.simulate(1, 2)["makespan"]
    assert fast < slow if pp > 1 else fast == slow, (fast, slow)
    assert fast >= 3 * n * chunks  # no rank can finish before its own work


def test_zero_bubble_figures():
    # unit F, B, W: 1F1B's bubble (pp - 1)(F + B + W) shrinks to (pp - 1)(F + B - W)
    assert zero_bubble(2, 4).simulate(1, 2)["makespan"] == 13 and one_f_one_b(2, 4).simulate(1, 2)["makespan"] == 15
    assert zero_bubble(4, 8).simulate(1, 2)["makespan"] == 29 and one_f_one_b(4, 8).simulate(1, 2)["makespan"] == 33
    assert zero_bubble(2, 4, 2).simulate(1, 2)["makespan"] == 25  # interleaved: 27
    assert str(zero_bubble(2, 4)).splitlines() == [
        "rank 0 | F0 F1 F2 B0 W0 B1 F3 W1 B2 W2 .. B3 W3",
        "rank 1 | .. F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3",
        "zb: pp=2 n_micro=4 chunks=1, F=1 B=2 time units, makespan 13, bubble 7.7%, max in flight [3, 2]",
    ]


def test_a_split_backward_takes_the_time_of_a_whole_one():
    sim = plan(2, 1, "F0 B0 W0", "F0 B0").simulate(t_forward=1.0, t_backward=4.0)
    spans = [[(s, e, a.label()) for s, e, a in r] for r in sim["spans"]]
    assert spans == [[(0, 1, "F0"), (6, 8, "B0"), (8, 10, "W0")], [(1, 2, "F0"), (2, 6, "B0")]]
    assert sim["max_in_flight"] == [1, 1]


@pytest.mark.parametrize("ranks, message", [
    (("F0 W0 B0", "F0 B0"), r"rank 0, action 1 \(W0: micro-batch 0, virtual stage 0\) comes before its backward B0"),
    (("F0 B0 W0 W0", "F0 B0"), r"rank 0, action 3 \(W0: .*\) runs twice \(first as action 2\)"),
    (("F0 B0 X0", "F0 B0"), r"rank 0, action 2 \(X0: .*\) is not an action of this schedule \(kind F, B or W"),
])
def test_validate_checks_weight_passes(ranks, message):
    with pytest.raises(PipelineError, match=message):
        plan(2, 1, *ranks).validate()


def test_str_draws_every_rank_and_the_bubble():
    text = str(one_f_one_b(2, 2))
    assert text.splitlines() == [
        "rank 0 | F0 F1 .. .. B0 -- .. B1 --",
        "rank 1 | .. F0 B0 -- F1 B1 -- .. ..",
        "1f1b: pp=2 n_micro=2 chunks=1, F=1 B=2 time units, makespan 9, bubble 33.3%, max in flight [2, 1]",
    ]
    big = str(interleaved_1f1b(4, 8, chunks=2))
    for r in range(4):
        assert f"\nrank {r} | " in "\n" + big
    assert "rank 0 | F0c0 F1c0 F2c0 F3c0 F0c1" in big
    assert "bubble 15.8%" in big
