"""Issue 53, item 3: packing without cross-document attention.

A packed row's batch carries ``position_ids`` (each token's position in its own sample); every model that takes
them attends inside each sample and places it at its own positions, so a packed row's loss and gradients are the
sum of its samples' run alone. Checked on one process for every model with document support, and through the
train step at tp=2 x dp=2, cp=2 (both layouts), tp=2 with sequence parallelism, pp=2 and dp=2 at ZeRO-3; the data
side (positions from the stream's sample starts, a sample's first token no target) on the loader's batches.
"""

import json

import optree
import pytest
import torch

import funcpar as fp
from funcpar.nn.documents import Documents
import harness
import hf_fixtures

T = 32
LENGTHS = [[10, 15, 7], [5, 27], [32], [1, 12, 19]]  # four rows: documents of 1 to 32 tokens, one row whole
MANY = [[5, 3, 6, 2, 4, 7, 5], [4] * 8, [9, 1, 6, 6, 3, 7], [2, 30]]  # rows of many short ones: one masked call
CONFIGS = {
    "llama": lambda: hf_fixtures.CONFIGS["llama"]().to_dict(),
    "mistral": lambda: hf_fixtures.CONFIGS["mistral"]().to_dict(),  # a window of 5, shorter than most samples
    "qwen2": lambda: hf_fixtures.CONFIGS["qwen2"]().to_dict(),
    "gpt2": lambda: hf_fixtures.CONFIGS["gpt2"]().to_dict(),  # learned positions
    "mixtral": lambda: {**hf_fixtures.CONFIGS["mixtral"]().to_dict(), "output_router_logits": False},
    "glm": lambda: hf_fixtures.config_dict("glm"),  # partial rotary on interleaved pairs
    "baichuan": lambda: hf_fixtures.config_dict("baichuan"),
}


def _setup(kind: str, mesh):
    raw = CONFIGS[kind]()
    model = fp.get_model(raw["model_type"])
    cfg = model.config(raw, mesh)
    return model, cfg, model.init(cfg, seed=3)


def _packed(vocab: int, seed: int = 0, lengths=None) -> tuple[dict, list]:
    """The packed batch (B=4, T=32) and its samples, ``[(row, start, length)]``."""
    lengths = LENGTHS if lengths is None else lengths
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), T), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    labels = ids.masked_fill(pos == 0, -100)  # (nothing in a sample predicts its first token)
    samples = [(b, sum(row[:k]), n) for b, row in enumerate(lengths) for k, n in enumerate(row)]
    return {"input_ids": ids, "labels": labels, "position_ids": pos}, samples


def _alone(model, cfg, params, batch, samples):
    """Summed loss and gradients of each sample run alone (a batch of one row, no position_ids), added up."""
    f = lambda p, b: model.loss(p, b, cfg=cfg, mesh=fp.Mesh(), reduction="sum")  # noqa: E731
    loss, grads = 0.0, None
    for b, a, n in samples:
        if n < 2:  # (one token predicts nothing: a batch with no targets)
            continue
        g, v = torch.func.grad_and_value(f)(params, {"input_ids": batch["input_ids"][b:b + 1, a:a + n]})
        loss += v.item()
        grads = g if grads is None else optree.tree_map(torch.add, grads, g)
    return loss, grads


def _assert_close(got, want, rel=1e-6):
    scale = max(x.abs().max().item() for x in optree.tree_leaves(want))
    for (path, x), y in zip(fp.tree.leaves_with_path(got), optree.tree_leaves(want), strict=True):
        assert (x - y).abs().max().item() <= rel * scale + 1e-7, (path, (x - y).abs().max().item(), scale)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_packed_rows_loss_and_gradients_are_its_samples_run_alone(kind):
    mesh = fp.Mesh()
    model, cfg, params = _setup(kind, mesh)
    batch, samples = _packed(min(cfg.vocab_size, 100))
    f = lambda p, b: model.loss(p, b, cfg=cfg, mesh=mesh, reduction="sum")  # noqa: E731
    grads, loss = torch.func.grad_and_value(f)(params, batch)
    want_loss, want_grads = _alone(model, cfg, params, batch, samples)
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    _assert_close(grads, want_grads)
    # without position_ids the same rows attend across their samples: another loss (what --cross-document keeps)
    across = model.loss(params, {k: batch[k] for k in ("input_ids", "labels")}, cfg=cfg, mesh=mesh, reduction="sum")
    assert abs(across.item() - want_loss) > 1e-3


@pytest.mark.parametrize("lengths, path", [
    ((70, 58), "the block-causal CPU kernel, its blocks masked by document (64-512 positions)"),
    ((3, 5, 2, 7, 4, 6, 5), "one call with the block-diagonal mask (many short documents)"),
    ((20, 12), "a kernel call per document (a few documents)"),
])
def test_every_attention_path_within_documents_is_each_document_alone(lengths, path, monkeypatch):
    """Outside torch.func (plain autograd), each of D.causal's paths gives each document's causal attention and its
    gradients; so does the compiled form (the mask)."""
    from funcpar.nn import attention as A
    from funcpar.nn import decoder as D

    taken = []

    def spy(name):
        real = getattr(A, name)
        return lambda *a, **kw: taken.append(name) or real(*a, **kw)

    for name in ("within_documents", "causal"):
        monkeypatch.setattr(A, name, spy(name))
    monkeypatch.setattr(A._BlockCausal, "apply", lambda *a, _f=A._BlockCausal.apply: taken.append("block") or _f(*a))
    torch.manual_seed(0)
    T = sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].repeat(2, 1)  # (2, T)
    q, k, v = (torch.randn(2, 4, T, 16, requires_grad=True) for _ in range(3))
    got = D.causal(q, k, v, fp.Mesh().with_documents(Documents(pos)))
    bounds = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(q[..., a:b, :], k[..., a:b, :],
                                                                       v[..., a:b, :], is_causal=True)
                      for a, b in zip(bounds, bounds[1:], strict=False)], 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert taken == {"the block": ["within_documents", "block"], "one call ": ["within_documents"],
                     "a kernel ": ["causal"] * len(lengths) * 2}[path[:9]], taken
    go = torch.randn_like(got)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), go), torch.autograd.grad(want, (q, k, v), go), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    compiled = torch.compile(lambda q, k, v, p: D.causal(q, k, v, fp.Mesh().with_documents(Documents(p))),
                             dynamic=False)
    torch.testing.assert_close(compiled(q, k, v, pos), want, rtol=1e-5, atol=1e-6)


def _step_grads(kind: str, sizes: dict, extra: dict, layout: str = "zigzag"):
    """One SGD step (lr 1) of the packed batch on ``harness.mesh(**sizes)``: ``(loss, whole gradients)`` from the
    parameters' change (rank 0's; None elsewhere)."""
    mesh = harness.mesh(**sizes).with_context_layout(layout)
    model, cfg, params = _setup(kind, mesh)
    specs = model.specs(cfg, mesh)
    batch, _ = _packed(min(cfg.vocab_size, 100), lengths=extra.pop("lengths", None))
    cp = "cp" in sizes
    dp, c = mesh.axis_size("dp"), mesh.coord("dp")
    local = {k: v[c * (len(v) // dp):(c + 1) * (len(v) // dp)] for k, v in batch.items()}
    sp = extra.pop("sequence_parallel", False)
    step = fp.compile_step(model.loss_fn(cfg, mesh, sequence_parallel=sp), specs, mesh=mesh,
                           optimizer=fp.optim.sgd(1.0), data_axes=("dp", "cp") if cp else ("dp",), **extra)
    state = step.init(fp.shard(params, specs, mesh) if "pp" not in sizes else _stage(params, step))
    before = step.gather_params(state)
    before = optree.tree_map(lambda x: x.clone() if x is not None else None, before, none_is_leaf=True)
    state, m = step(state, local)
    after = step.gather_params(state)
    diff = optree.tree_map(lambda a, b: None if a is None else a - b, before, after, none_is_leaf=True)
    if "pp" in sizes:
        return m["loss"], _whole_stages(diff, mesh)
    whole = fp.gather(diff, specs, mesh)
    return m["loss"], whole if mesh.rank == 0 else None


def _stage(params, step):
    return fp.tree.map_with_path(lambda p, x: x if step.holds(p) else None, params)


def _whole_stages(tree, mesh):
    """Every stage's leaves on rank 0 (a stage tree holds None for the others)."""
    import torch.distributed as dist

    got = [None] * mesh.size
    dist.all_gather_object(got, fp.tree.map_with_path(lambda p, x: x, tree))
    merged = got[0]
    for other in got[1:]:
        merged = optree.tree_map(lambda a, b: a if a is not None else b, merged, other, none_is_leaf=True)
    return merged


MESHES = [  # (world, kind, sizes, step options, cp layout)
    (4, "llama", {"tp": 2, "dp": 2}, {}, "zigzag"),
    (4, "qwen2", {"tp": 2, "dp": 2}, {}, "zigzag"),
    (4, "gpt2", {"tp": 2, "dp": 2}, {}, "zigzag"),
    (2, "llama", {"cp": 2}, {}, "zigzag"),
    (2, "llama", {"cp": 2}, {}, "contiguous"),
    (2, "glm", {"cp": 2}, {}, "zigzag"),
    (4, "mistral", {"cp": 2, "tp": 2}, {}, "zigzag"),
    (2, "llama", {"tp": 2}, {"sequence_parallel": True}, "zigzag"),
    (2, "gpt2", {"tp": 2}, {"sequence_parallel": True}, "zigzag"),
    (2, "llama", {"dp": 2}, {"zero": 3}, "zigzag"),
    (2, "llama", {"pp": 2}, {"accum_steps": 2}, "zigzag"),
    (2, "llama", {"cp": 2}, {"lengths": MANY}, "zigzag"),
    (2, "llama", {"cp": 2}, {"lengths": MANY}, "contiguous"),
    (4, "llama", {"tp": 2, "dp": 2}, {"lengths": MANY}, "zigzag"),
]


@pytest.mark.parametrize("world, kind, sizes, extra, layout", MESHES,
                         ids=[f"{k}-{'x'.join(f'{a}{n}' for a, n in s.items())}-{'-'.join(map(str, e)).replace('lengths', 'many') or layout}-{layout}"
                              for _, k, s, e, layout in MESHES])
def test_packed_rows_through_the_step_are_their_samples_alone_on_a_mesh(world, kind, sizes, extra, layout):
    """The step's mean loss and gradient on a packed batch equal the samples' run alone, summed and divided by
    their targets (a document crossing a cp piece or a pipeline micro-batch's rows included)."""
    mesh = fp.Mesh()
    model, cfg, params = _setup(kind, mesh)
    batch, samples = _packed(min(cfg.vocab_size, 100), lengths=extra.get("lengths"))
    want_loss, want_grads = _alone(model, cfg, params, batch, samples)
    targets = sum(n - 1 for _, _, n in samples if n > 1)
    loss, grads = harness.run(world, _step_grads, kind, sizes, dict(extra), layout)[0]
    assert loss == pytest.approx(want_loss / targets, rel=1e-6)
    _assert_close(grads, optree.tree_map(lambda g: g / targets, want_grads), rel=2e-6)


def test_the_loader_marks_each_samples_positions_and_no_target_across_samples(tmp_path):
    """Rows cut from the stream restart positions at each sample start and at the row's start; a sample's first
    token is never a target; a held-out pass reads the same; --cross-document's rows carry no position_ids."""
    tok = fp.data.ByteTokenizer()
    samples = [({"text": "x" * n}, f"s{n}") for n in (5, 20, 3, 40, 9, 11)]  # (+1 EOS each)
    data = fp.data.Dataset.from_samples(samples, tok, seq_len=16, documents=True)
    batch = fp.data.Mixture([data]).take_range(0, len(data))
    starts = [0]
    for n in (5, 20, 3, 40, 9, 11):
        starts.append(starts[-1] + n + 1)
    flat = torch.arange(len(data) * 16)
    begin = torch.tensor([max([s for s in starts if s <= t] + [t - t % 16]) for t in flat.tolist()])
    assert torch.equal(batch["position_ids"].reshape(-1), flat - begin)
    assert bool((batch["labels"][batch["position_ids"] == 0] == -100).all())
    assert bool((batch["labels"][batch["position_ids"] > 0] >= 0).all())
    loader = fp.data.Loader(fp.data.Mixture([data]), fp.Mesh(), 4, seed=1)
    b = next(loader)
    rows = [torch.equal(b["input_ids"][i], batch["input_ids"][j]) for i in range(4) for j in range(len(data))]
    assert sum(rows) >= 4 and set(b) == {"input_ids", "labels", "position_ids"}
    plain = fp.data.Dataset.from_samples(samples, tok, seq_len=16)
    assert set(fp.data.Mixture([plain]).take_range(0, 2)) == {"input_ids", "labels"}


def test_a_model_without_document_support_refuses_position_ids_by_name():
    model = fp.get_model("bloom")
    raw = hf_fixtures.CONFIGS["bloom"]().to_dict()
    cfg = model.config(raw, fp.Mesh())
    check = model.loss_fn(cfg, fp.Mesh()).check_batch
    batch, _ = _packed(100)
    assert check(batch)[0].startswith("batch['position_ids']: model 'bloom' does not take packed documents")
    llama = fp.get_model("llama")
    lcfg = llama.config(CONFIGS["llama"](), fp.Mesh())
    bad = dict(batch, position_ids=batch["position_ids"] + 40)
    assert llama.loss_fn(lcfg, fp.Mesh()).check_batch(bad)[0].startswith(
        "batch['position_ids'] holds 40 at [0, 0], outside [0, 32)")
    assert json.dumps(llama.loss_fn(lcfg, fp.Mesh()).check_batch(batch)) == "[]"


def test_the_plan_traces_the_document_path_that_funcpar_train_takes(monkeypatch, capsys):
    """`funcpar plan` traces batches with position_ids (funcpar train's default), through the layers' document
    path; `--cross-document` plans without them."""
    from funcpar.cli import main as cli
    from funcpar.nn import decoder as D

    seen = []
    real = D._by_document
    monkeypatch.setattr(D, "_by_document", lambda *a: seen.append(a[0].is_meta) or real(*a))
    cli.main(["plan", "--mesh", "cp=2,tp=2", "--model", "llama-micro"])
    with_docs = capsys.readouterr().out.splitlines()[-1]
    assert seen and all(seen)
    seen.clear()
    cli.main(["plan", "--mesh", "cp=2,tp=2", "--model", "llama-micro", "--cross-document"])
    without = capsys.readouterr().out.splitlines()[-1]
    assert not seen and with_docs != without
