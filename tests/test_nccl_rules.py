"""What NCCL does differently from gloo, held on gloo (one GPU is all a test machine has: issue 40).

NCCL ignores message tags and pairs the messages between two ranks of one communicator by posting order; it needs
every member of a communicator to post the same collectives in the same order. ``funcpar.parallel.p2p.USE_TAGS = False``
makes gloo match the pipeline's messages by posting order too (one tag for all), and
``funcpar.parallel.transport.recording`` / ``check_sequences`` hold every rank's posted collectives and messages to both
rules. The pipelines, ZeRO 0-3 and tp are run under them here.
"""

import pytest
import torch

import funcpar as fp
import harness
from funcpar.parallel import p2p
from funcpar.parallel import transport

V, B, T = 96, 16, 8


def batches(n):
    return harness.token_batches(n, V, B, T, seed=70, masked=5)


local = harness.dp_share


def _config(layers):
    from funcpar.models import llama

    return llama.Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_windows=(None,) * layers)


def make(mesh, micro, pipeline, chunks):
    model, cfg = fp.get_model("llama"), _config(4)
    specs = model.specs(cfg, mesh)
    step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, optimizer=fp.optim.adamw(1e-3, weight_decay=0.1),
                           accum_steps=micro, clip_norm=0.5, pipeline=pipeline, chunks=chunks)
    return step, specs, model, cfg


def _tags_swapped(use_tags: bool):
    """Rank 0 sends a then b under tags 1 and 2; rank 1 posts its receive for tag 2 first: a schedule that leans on
    tags to match."""
    mesh = harness.mesh(pp=2)
    old, p2p.USE_TAGS = p2p.USE_TAGS, use_tags
    try:
        with transport.recording() as log:
            if mesh.rank == 0:
                sends = [p2p.isend(torch.full((3,), v), mesh, "pp", 1, tag) for v, tag in ((1.0, 1), (2.0, 2))]
                for s in sends:
                    s.wait()
                got = None
            else:
                second = p2p.irecv(torch.empty(3), mesh, "pp", 0, 2)
                first = p2p.irecv(torch.empty(3), mesh, "pp", 0, 1)
                got = (first.wait()[0].item(), second.wait()[0].item())
    finally:
        p2p.USE_TAGS = old
    return got, list(log)


def test_the_tag_dropping_transport_and_the_order_check_catch_a_schedule_that_leans_on_tags():
    (_, log0), (got, log1) = harness.run(2, _tags_swapped, True)
    assert got == (1.0, 2.0)  # gloo matched by tag: right here, wrong on NCCL
    with pytest.raises(fp.CollectiveError, match=r"send #0 is 1 12 but receive #0 is 2 12: NCCL pairs them by "
                                                 r"posting order"):
        transport.check_sequences([log0, log1])
    (_, _), (got, _) = harness.run(2, _tags_swapped, False)
    assert got == (2.0, 1.0)  # tags dropped: the first receive takes the first send, as NCCL would


def _different_collectives():
    mesh = harness.mesh(dp=2)
    with transport.recording() as log:
        # (the same size: gloo runs it either way, where NCCL would mix sums and maxima)
        fp.collectives.all_reduce(torch.ones(4), mesh, "dp", "sum" if mesh.rank == 0 else "max")
    return list(log)


def test_the_order_check_names_collectives_that_differ_between_ranks():
    logs = harness.run(2, _different_collectives)
    with pytest.raises(fp.CollectiveError, match=r"ranks 0 and 1 of group \[0, 1\] post different collectives: #0 "
                                                 r"is all_reduce\(sum\) 32 on rank 0 and all_reduce\(max\) 32 on rank 1"):
        transport.check_sequences(logs)


def _pipeline_run(sizes, pipeline, chunks, use_tags):
    mesh = harness.mesh(**sizes)
    old, p2p.USE_TAGS = p2p.USE_TAGS, use_tags
    try:
        step, specs, model, cfg = make(mesh, 4, pipeline, chunks)
        state = step.init(fp.shard(model.init(cfg, seed=0), specs, mesh))
        losses = []
        with transport.recording() as log:
            for b in batches(2):
                state, m = step(state, local(b, mesh))
                losses.append(m["loss"])
        return losses, fp.gather(state.params, specs, mesh), list(log)
    finally:
        p2p.USE_TAGS = old


@pytest.mark.parametrize("pipeline,chunks", [("gpipe", None), ("1f1b", None), ("interleaved", 2), ("zb", None),
                                             ("zb", 2)])
def test_every_pipeline_schedule_keeps_nccls_rules_and_runs_without_tags(pipeline, chunks):
    sizes = {"pp": 2, "dp": 2}
    tagged = harness.run(4, _pipeline_run, sizes, pipeline, chunks, True)
    untagged = harness.run(4, _pipeline_run, sizes, pipeline, chunks, False)
    transport.check_sequences([log for _, _, log in tagged])
    assert any(e[0] == "p2p" for e in tagged[0][2])  # (the stages did exchange messages)
    # each communicator carries messages one way between two ranks: two ranks sending to each other on one NCCL
    # communicator can each wait for the other's receive, queued behind its own send (interleaved schedules wrap
    # around from the last rank to the first: those streams have communicators of their own)
    sent = {(e[2], e[3], e[4]) for _, _, log in tagged for e in log if e[:2] == ("p2p", "send")}
    both = sorted((g, a, b) for g, a, b in sent if (g, b, a) in sent)
    assert not both, both
    # matched by posting order alone, every rank trains to the same bits as with tags
    for (l1, p1, _), (l2, p2, _) in zip(tagged, untagged, strict=True):
        assert l1 == l2
        for (_, x), (_, y) in zip(fp.tree.leaves_with_path(p1), fp.tree.leaves_with_path(p2), strict=True):
            assert torch.equal(x, y)


def _data_parallel_run(sizes, zero):
    mesh = harness.mesh(**sizes)
    model, cfg = fp.get_model("llama"), _config(2).with_mesh(mesh)
    specs = model.specs(cfg, mesh)
    step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, zero=zero, accum_steps=2, clip_norm=1.0)
    state = step.init(fp.shard(model.init(cfg, seed=0), specs, mesh))
    with transport.recording() as log:
        for b in batches(2):
            state, _ = step(state, local(b, mesh))
    return list(log)


@pytest.mark.parametrize("sizes,zero", [({"tp": 2, "dp": 2}, 1), ({"tp": 2, "dp": 2}, 2), ({"tp": 2, "dp": 2}, 3),
                                        ({"dp": 4}, 2), ({"dp": 2, "tp": 2}, 0)])
def test_every_rank_posts_the_same_collectives_in_the_same_order(sizes, zero):
    logs = harness.run(4, _data_parallel_run, sizes, zero)
    transport.check_sequences(logs)
    ops = {e[2] for log in logs for e in log if e[0] == "collective"}
    assert "all_reduce(sum)" in ops and (zero == 0 or "reduce_scatter" in ops or "all_gather" in ops), ops
