"""Mixtral (sparse mixture of experts) against transformers' MixtralForCausalLM, and expert parallelism (ep) against
one process: the all_to_all collective, logits at Mesh(), Mesh(tp=2), Mesh(ep=2), Mesh(ep=2, tp=2) and
Mesh(ep=2, dp=2), the loss with its load-balancing term, three AdamW steps of compile_step on the ep meshes, and the HF
checkpoints: the per-expert layout save_pretrained writes by default (and the Hub holds) read with each rank's bytes
only and written back as it was, the fused layout transformers 5 holds in memory read too.

ep is a data axis: each (dp, ep) rank holds its own rows of the global batch, data axes major as the mesh orders
them (rank k of dp x ep holds block k)."""

import functools
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file

import funcpar as fp
import harness
from hf_fixtures import folder_tensors
from funcpar.parallel import collectives as C
from funcpar.models import mixtral

B, T, V, STEPS = 4, 12, 128, 3
EP_MESHES = [({"ep": 2}, 2), ({"ep": 2, "tp": 2}, 4), ({"ep": 2, "dp": 2}, 4)]  # (mesh axes, processes)
# tp alone (no ep axis, every expert on every rank); tp=4 is not: the 2 kv heads of the test model do not split over 4
FORWARD_MESHES = [({"tp": 2}, 2), *EP_MESHES]


def hf_config():
    import transformers as tf

    # 4 experts (ep=2 holds 2 each), top-2, GQA, a sliding window shorter than the sequence
    return tf.MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                            router_aux_loss_coef=0.02, output_router_logits=True, sliding_window=8,
                            max_position_embeddings=64)


def batches(n=STEPS):
    out = []
    for s in range(n):
        ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(10 + s))
        labels = ids.clone()
        labels[s % B, : 3 + s] = -100  # the data ranks hold different numbers of targets
        out.append({"input_ids": ids, "labels": labels})
    return out


def rows(batch: dict, mesh) -> dict:
    """This rank's rows of a global batch: its block along the data axes (dp, ep)."""
    k, n = 0, 1
    for a in mixtral.DATA_AXES:
        if a in mesh.axis_names:
            k, n = k * mesh.axis_size(a) + mesh.coord(a), n * mesh.axis_size(a)
    return {key: x.chunk(n)[k] for key, x in batch.items()}


def assert_rel(got, want, tol=1e-5, what=""):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err, scale = (got - want).abs().max().item(), max(want.abs().max().item(), 1e-30)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A transformers Mixtral saved by save_pretrained's defaults (one tensor per expert, as on the Hub), its outputs
    on the first batch."""
    import transformers as tf

    folder = tmp_path_factory.mktemp("mixtral") / "ckpt"
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(hf_config()).eval()
    with torch.no_grad():  # non-trivial norms, so that a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    b = batches(1)[0]
    with torch.no_grad():
        ref = model(**b, output_router_logits=True)
    return str(folder), ref, b


# ------------------------------------------------------------------------------------------------- all_to_all


def _all_to_all(sizes, dim, seed):
    """all_to_all over ep: each rank's forward, gradient (torch.func.grad, .backward(), vmap) and traffic."""
    m = harness.mesh(**sizes)
    n, r = m.axis_size("ep"), m.coord("ep")
    Xs, Cs = _a2a_problem(n, dim, seed)
    coll = lambda t: C.all_to_all(t, m, "ep", dim)  # noqa: E731
    objective = lambda x: (Cs[r] * coll(x).sin()).sum()  # noqa: E731
    before = m.traffic.get("ep", 0)
    fwd = coll(Xs[r])
    sent = m.traffic["ep"] - before
    xb = Xs[r].clone().requires_grad_(True)
    objective(xb).backward()
    batch = torch.stack([Xs[r], 0.5 * Xs[r]])
    vfwd = torch.func.vmap(coll, in_dims=1, out_dims=1)(batch.movedim(0, 1))
    vgrad = torch.func.grad(lambda b: torch.func.vmap(objective)(b).sum())(batch)
    sep_grad = torch.stack([torch.func.grad(objective)(Xs[r]), torch.func.grad(objective)(0.5 * Xs[r])])
    return {"r": r, "n": n, "fwd": fwd, "grad": torch.func.grad(objective)(Xs[r]), "grad_bw": xb.grad, "sent": sent,
            "vfwd": vfwd, "sep_fwd": torch.stack([coll(x) for x in batch]), "vgrad": vgrad, "sep_grad": sep_grad}


def _a2a_problem(n, dim, seed):
    g = torch.Generator().manual_seed(seed)
    shape = [3, 5]
    shape[dim] = 2 * n
    return torch.randn(n, *shape, generator=g), torch.randn(n, *shape, generator=g)


def _a2a_reference(Xs, n, dim):
    """One process: rank j receives block j of every rank's tensor, in rank order."""
    return [torch.cat([Xs[s].chunk(n, dim)[j] for s in range(n)], dim) for j in range(n)]


@pytest.mark.parametrize("sizes, world", [({"ep": 2}, 2), ({"ep": 4}, 4)], ids=str)
def test_all_to_all_value_and_gradient_match_one_process(sizes, world):
    for dim, seed in ((0, 1), (1, 2)):
        for res in harness.run(world, _all_to_all, sizes, dim, seed):
            r, n = res["r"], res["n"]
            Xs, Cs = _a2a_problem(n, dim, seed)
            want = _a2a_reference(Xs, n, dim)[r]
            gX = torch.func.grad(lambda X: sum((Cs[j] * y.sin()).sum()
                                               for j, y in enumerate(_a2a_reference(X, n, dim))))(Xs)
            where = f"ep={n} rank {r} dim={dim}"
            assert torch.equal(res["fwd"], want), where
            assert_rel(res["grad"], gX[r], 1e-6, f"{where} torch.func.grad")
            assert_rel(res["grad_bw"], gX[r], 1e-6, f"{where} .backward()")
            assert_rel(res["vfwd"], res["sep_fwd"].movedim(0, 1), 1e-6, f"{where} vmap forward (in_dims=1)")
            assert_rel(res["vgrad"], res["sep_grad"], 1e-6, f"{where} vmap gradient")
            assert res["sent"] == Xs[r].numel() * 4 * (n - 1) / n, where  # the blocks for the other ranks


def test_all_to_all_on_an_abstract_mesh_is_simulated_and_checks_its_blocks():
    mesh = fp.Mesh.abstract(ep=4)  # seen from rank 0, every rank taken to hold its values: each sends it block 0
    x = torch.arange(24.0).reshape(8, 3)
    assert torch.equal(C.all_to_all(x, mesh, "ep"), x[:2].repeat(4, 1))
    assert mesh.traffic["ep"] == x.numel() * 4 * 3 / 4
    with pytest.raises(fp.CollectiveError, match="dimension 1 .* is not divisible by mesh axis 'ep' of size 4"):
        C.all_to_all(x, mesh, "ep", dim=1)


# --------------------------------------------------------------------------------------- against transformers


def _aux(params, tokens, cfg, mesh):
    """The load-balancing loss of the global batch (every data rank's ``tokens``): transformers' ``aux_loss``."""
    _, counts, prob_sum = mixtral._trunk(params, tokens, cfg, mesh)
    return mixtral._balance_loss(counts, prob_sum, tokens.numel() * cfg.num_hidden_layers, cfg, mesh)


def test_logits_loss_and_aux_loss_match_transformers_single_process(ckpt):
    path, ref, b = ckpt
    params, cfg = fp.hf.load(path)
    assert cfg.model_type == "mixtral" and cfg.num_local_experts == 4 and cfg.output_router_logits
    model = fp.get_model("mixtral")
    assert (model.forward(params, b["input_ids"], cfg, fp.Mesh()) - ref.logits).abs().max().item() <= 1e-5
    aux = _aux(params, b["input_ids"], cfg, fp.Mesh())
    assert abs(aux.item() - ref.aux_loss.item()) <= 1e-6 * ref.aux_loss.item() and aux.item() > 1.0
    loss = model.loss(params, b, cfg, fp.Mesh())
    assert abs(loss.item() - ref.loss.item()) <= 1e-6 * ref.loss.item()
    ce = model.loss(params, b, cfg, fp.Mesh(), aux=False)  # transformers without output_router_logits
    assert abs(ce.item() + cfg.router_aux_loss_coef * ref.aux_loss.item() - ref.loss.item()) <= 1e-6 * ref.loss.item()


def _ep_forward(path, sizes, b, out):
    """This rank's logits, loss, target count and the load-balancing loss; the gradient of the global loss
    (gathered on rank 0); an export of the sharded weights; the bytes it read, and its leaves' bytes (all, and the
    experts')."""
    mesh = harness.mesh(**sizes)
    stats = {}
    params, cfg = fp.hf.load(path, mesh=mesh, stats=stats)
    nbytes = {p: x.numel() * x.element_size() for p, x in fp.tree.leaves_with_path(params)}
    read = (stats["bytes_read"], sum(nbytes.values()), sum(n for p, n in nbytes.items() if ".w_" in p))
    specs = mixtral.specs(cfg, mesh)
    local = rows(b, mesh)
    logits = mixtral.forward(params, local["input_ids"], cfg, mesh)
    loss = mixtral.loss(params, local, cfg, mesh)
    aux = _aux(params, local["input_ids"], cfg, mesh)
    share = fp.layers.count_targets(local) / fp.layers.count_targets(b)  # the step's weight of this rank's loss
    grads = torch.func.grad(lambda p: mixtral.loss(p, local, cfg, mesh) * share)(params)
    data = [a for a in mixtral.DATA_AXES if a in mesh.axis_names and mesh.axis_size(a) > 1]
    # the step's reduction: summed over the data axes a leaf is replicated along (the experts' over dp only)
    grads = fp.tree.map_with_path(lambda _, g, s: C.all_reduce(g, mesh, [a for a in data if a not in s.axes]),
                                  grads, specs)
    fp.hf.save(out, params, mixtral, cfg, mesh)
    return (mesh.coords, logits, loss.item(), fp.layers.count_targets(local), aux.item(),
            fp.gather(grads, specs, mesh, dst=0), read)


@pytest.mark.parametrize("sizes, world", FORWARD_MESHES, ids=str)
def test_logits_loss_and_gradients_match_transformers_on_tp_and_ep_meshes(ckpt, sizes, world, tmp_path):
    path, ref, b = ckpt
    results = harness.run(world, _ep_forward, path, sizes, b, str(tmp_path / "out"))
    ep = sizes.get("ep", 1)
    n = sizes.get("dp", 1) * ep
    targets = fp.layers.count_targets(b)
    weighted = 0.0
    for coords, logits, loss, count, aux, _, _ in results:
        k = coords["dp"] * ep + coords.get("ep", 0)
        tp, c = sizes.get("tp", 1), coords["tp"]
        want = ref.logits.chunk(n)[k].chunk(tp, -1)[c]  # this rank's rows, its block of the vocabulary
        assert (logits - want).abs().max().item() <= 1e-5, coords
        assert abs(aux - ref.aux_loss.item()) <= 1e-6 * ref.aux_loss.item(), coords  # over the global batch
        weighted += loss * count / targets / tp  # the step's weighting, each tp rank's copy once
    assert abs(weighted - ref.loss.item()) <= 1e-6 * ref.loss.item()
    params, cfg = fp.hf.load(path)
    want = torch.func.grad(lambda p: mixtral.loss(p, b, cfg, fp.Mesh()))(params)  # one process, the whole batch
    for (p, g), (_, w) in zip(fp.tree.leaves_with_path(results[0][5]), fp.tree.leaves_with_path(want), strict=True):
        assert_rel(g, w, 1e-5, f"gradient of {p}")
    assert sorted(load_file(os.path.join(tmp_path / "out", "model.safetensors"))) == sorted(_tensors(path))
    for name, t in load_file(os.path.join(tmp_path / "out", "model.safetensors")).items():
        assert torch.equal(t, _tensors(path)[name]), name  # gathered from the ep/tp shards exactly
    _assert_reads_its_own_blocks(path, sizes, [r[6] for r in results])
    _assert_transformers_loads_the_export(path, str(tmp_path / "out"), ref, b)


def _assert_reads_its_own_blocks(path, sizes, reads):
    """Each rank read exactly its leaves' bytes: of the experts 1/(ep*tp) (its own experts' tensors, and of each its
    tp block), of attention, embedding and head its tp share, the router and norms whole."""
    tensors = _tensors(path)
    experts = sum(t.numel() * t.element_size() for n, t in tensors.items() if ".experts." in n)
    split = sizes.get("ep", 1) * sizes.get("tp", 1)
    for got, leaves, expert_leaves in reads:
        assert got == leaves, (sizes, got, leaves)
        assert expert_leaves * split == experts, (sizes, expert_leaves, experts)


def _assert_transformers_loads_the_export(path, out, ref, b):
    """transformers reads the export as it reads the folder save_pretrained wrote: the same weights, the same
    logits."""
    import transformers as tf

    hf = tf.MixtralForCausalLM.from_pretrained(out).eval()
    want = tf.MixtralForCausalLM.from_pretrained(path).state_dict()
    got = hf.state_dict()
    assert sorted(got) == sorted(want)
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
    with torch.no_grad():
        assert torch.equal(hf(input_ids=b["input_ids"]).logits, ref.logits)


# ------------------------------------------------------------------------------------------------- training


def train(path, mesh, data_axes):
    params, cfg = fp.hf.load(path, mesh=mesh)
    specs = mixtral.specs(cfg, mesh)
    step = fp.compile_step(mixtral.MODEL.loss_fn(cfg, mesh), specs, mesh=mesh, data_axes=data_axes,
                           optimizer=fp.optim.adamw(1e-3, weight_decay=0.1))
    state = step.init(params)
    losses = []
    for b in batches():
        state, m = step(state, rows(b, mesh))
        losses.append(m["loss"])
    return losses, fp.gather(state.params, specs, mesh, dst=0)


@functools.lru_cache(maxsize=None)
def single(path):
    return train(path, fp.Mesh(), ("dp",))


def _ep_train(path, sizes):
    return train(path, harness.mesh(**sizes), ("dp", "ep"))


@pytest.mark.parametrize("sizes, world", EP_MESHES, ids=str)
def test_adamw_steps_with_expert_parallelism_equal_the_single_process_run(ckpt, sizes, world):
    path, ref, _ = ckpt
    s_losses, s_params = single(path)
    assert abs(s_losses[0] - ref.loss.item()) <= 1e-6 * ref.loss.item()  # the loss with its load-balancing term
    assert s_losses[-1] < s_losses[0]
    losses, params = harness.run(world, _ep_train, path, sizes)[0]
    for a, b in zip(losses, s_losses, strict=True):
        assert abs(a - b) <= 1e-5 * b, (losses, s_losses)
    # per leaf, relative in norm (Adam turns the round-off of a near-zero gradient element into a whole step for
    # that element, so element-wise the expert leaves differ by up to ~1e-5 of their largest value); and against
    # the update: the difference is a tiny fraction of how far the three steps moved the leaf
    for (p, x), (_, y), (_, x0) in zip(fp.tree.leaves_with_path(params), fp.tree.leaves_with_path(s_params),
                                      fp.tree.leaves_with_path(fp.hf.load(path)[0]), strict=True):
        assert (x - y).norm() <= 1e-5 * y.norm(), p
        assert (x - y).norm() <= 1e-3 * (y - x0).norm(), p  # every leaf moved, every expert included


# ---------------------------------------------------------------------------------------------- checkpoints


def _tensors(folder):
    return folder_tensors(folder)


def test_round_trip_is_byte_identical_and_loads_in_transformers(ckpt, tmp_path):
    import transformers as tf

    path, ref, b = ckpt
    params, cfg = fp.hf.load(path)
    a = _tensors(path)
    assert tuple(params["layers"][0]["w_gate"].shape) == (4, 64, 32)  # the experts' w1 tensors, stacked
    for j in range(4):
        for leaf, w in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
            assert torch.equal(params["layers"][1][leaf][j], a[f"model.layers.1.block_sparse_moe.experts.{j}.{w}.weight"])
    fp.hf.save(tmp_path / "out", params, mixtral, cfg)
    c = _tensors(tmp_path / "out")
    assert sorted(a) == sorted(c)  # the layout save_pretrained wrote, one tensor per expert
    for name in a:
        assert a[name].dtype == c[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8), c[name].view(torch.uint8)), name
    hf = tf.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (hf(input_ids=b["input_ids"]).logits - ref.logits).abs().max().item() == 0.0


def test_the_fused_layout_transformers_holds_in_memory_is_read_too(ckpt, tmp_path):
    import transformers as tf

    path, _, _ = ckpt
    tf.MixtralForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "fused", save_original_format=False)
    fused = _tensors(tmp_path / "fused")
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused and not any(".block_sparse_moe." in n for n in fused)
    got, cfg = fp.hf.load(tmp_path / "fused")
    for (p, x), (_, y) in zip(fp.tree.leaves_with_path(got), fp.tree.leaves_with_path(fp.hf.load(path)[0]),
                              strict=True):
        assert torch.equal(x, y), p
    fp.hf.save(tmp_path / "out", got, mixtral, cfg)  # written in the per-expert layout
    out, want = _tensors(tmp_path / "out"), _tensors(path)
    assert sorted(out) == sorted(want) and all(torch.equal(out[n], want[n]) for n in want)


def test_a_folder_that_fits_neither_layout_is_refused_in_one_line(ckpt, tmp_path):
    import transformers as tf
    from safetensors.torch import save_file

    path, _, _ = ckpt
    tf.MixtralForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "fused", save_original_format=False)
    mixed = {n: t for n, t in _tensors(path).items() if not n.startswith("model.layers.0.")}  # layer 1 per expert
    mixed.update({n: t for n, t in _tensors(tmp_path / "fused").items() if n.startswith("model.layers.0.")})
    folder = tmp_path / "mixed"
    folder.mkdir()
    save_file(mixed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text((tmp_path / "fused" / "config.json").read_text())
    with pytest.raises(fp.hf.HFError) as e:
        fp.hf.load(folder)
    msg = str(e.value)
    assert "\n" not in msg
    x = r"model\.layers\.0\.block_sparse_moe\.experts\.0"
    assert re.fullmatch(
        rf"checkpoint .*mixed does not match model 'mixtral' built from its config\.json \(the nearest of the 2 "
        rf"layouts it reads; the others name tensors such as 'model\.layers\.0\.mlp\.experts\.down_proj'\): "
        rf"missing \(13\): {x}\.w1\.weight \[64, 32\], {x}\.w2\.weight \[32, 64\], {x}\.w3\.weight \[64, 32\] "
        rf"and 10 more; unexpected \(3\): model\.layers\.0\.mlp\.experts\.down_proj \[4, 32, 64\] in "
        rf"model\.safetensors, .*: check that config\.json is the one saved with these weights .*", msg), msg


def test_sizes_the_mesh_does_not_divide_are_refused_by_name():
    cfg = mixtral.Config.from_hf(hf_config().to_dict())
    with pytest.raises(ValueError, match="num_local_experts=4 is not divisible by mesh axis 'ep' of size 3"):
        mixtral.specs(cfg, fp.Mesh.abstract(ep=3))
    with pytest.raises(ValueError, match="num_experts_per_tok=5 exceeds num_local_experts=4"):
        mixtral.Config.from_hf({**hf_config().to_dict(), "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="config key 'router_jitter_noise' is 0.1"):
        mixtral.Config.from_hf({**hf_config().to_dict(), "router_jitter_noise": 0.1})


# ------------------------------------------------------------------------------ ZeRO-3 and pipeline stages


def _staged_train(path, sizes, data_axes, **options):
    """Three AdamW steps of the model without the load-balancing term (the staged form carries only the hidden
    state), on ``sizes`` (``{}``: one process); the global parameters on rank 0."""
    import dataclasses

    mesh = harness.mesh(**sizes) if sizes else fp.Mesh()
    params, cfg = fp.hf.load(path, mesh=mesh)
    cfg = dataclasses.replace(cfg, output_router_logits=False)
    specs = mixtral.specs(cfg, mesh)
    step = fp.compile_step(mixtral.MODEL.loss_fn(cfg, mesh), specs, mesh=mesh, data_axes=data_axes,
                           optimizer=fp.optim.adamw(1e-3, weight_decay=0.1), accum_steps=2, **options)
    state = step.init(step.executor.plan.select(params) if step.executor is not None else params)
    losses = []
    for b in batches():
        state, m = step(state, rows(b, mesh))
        losses.append(m["loss"])
    return losses, fp.gather(step.gather_params(state), specs, mesh, dst=0)


STAGED = [({"dp": 2}, ("dp",), {"zero": 3}), ({"pp": 2, "dp": 2}, ("dp",), {"zero": 3}),
          ({"pp": 2, "ep": 2}, ("dp", "ep"), {"zero": 1}),
          ({"pp": 2, "dp": 2}, ("dp",), {"pipeline": "interleaved", "parts": [0.5, 0.5, 0.5, 0.5]})]


@pytest.mark.parametrize("sizes, data_axes, options", STAGED, ids=str)
def test_zero3_and_pipeline_stages_equal_the_single_process_run(ckpt, sizes, data_axes, options):
    """Mixtral's staged form (embed -> attention half, MoE half ... -> head) at ZeRO-3, on pipeline stages (with
    experts over ep, and a layer cut between its halves) against one process, in float32: the bar of the ep test."""
    path = ckpt[0]
    ref_losses, ref = _staged_train(path, {}, ("dp",))
    world = 1
    for n in sizes.values():
        world *= n
    losses, params = harness.run(world, _staged_train, path, sizes, data_axes, **options)[0]
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= 1e-5 * b, (losses, ref_losses)
    for (p, x), (_, y) in zip(fp.tree.leaves_with_path(params), fp.tree.leaves_with_path(ref), strict=True):
        assert (x - y).norm() <= 1e-5 * y.norm(), p


def _refusals(path):
    mesh = harness.mesh(ep=2)
    params, cfg = fp.hf.load(path, mesh=mesh)
    out = []
    for cfg_, kw in ((cfg, {"zero": 1}), (__import__("dataclasses").replace(cfg, output_router_logits=False),
                                           {"zero": 3})):
        step = fp.compile_step(mixtral.MODEL.loss_fn(cfg_, mesh), mixtral.specs(cfg_, mesh), mesh=mesh,
                               data_axes=("dp", "ep"), **kw)
        try:
            step(step.init(params), rows(batches(1)[0], mesh)) if kw["zero"] == 1 else step.init(params)
            out.append(None)
        except (fp.StepError, ValueError) as e:
            out.append(str(e))
    step = fp.compile_step(mixtral.MODEL.loss_fn(cfg, fp.Mesh()), mixtral.specs(cfg), mesh=fp.Mesh(), zero=3)
    try:
        step(step.init(fp.hf.load(path)[0]), batches(1)[0])
        out.append(None)
    except ValueError as e:
        out.append(str(e))
    return out


def test_what_the_staged_form_cannot_carry_is_refused_by_name(ckpt):
    """ZeRO-3 on a mesh whose experts are split over ep (a unit's bucket differs across ep ranks), and the
    load-balancing loss through the staged form (its statistics are not carried between layers)."""
    fine, ep3, aux = harness.run(2, _refusals, ckpt[0])[0]
    assert fine is None  # zero=1 on ep=2 with the load-balancing loss: the unstaged loss, as before
    assert re.search(r"zero=3 partitions every block over the data axes ep, but leaf 'layers\.0\.w_(gate|up|down)' "
                     r"is split over 'ep'", ep3), ep3
    assert "output_router_logits=True" in aux and "set output_router_logits=False" in aux, aux


def _config_folder(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
        "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.0}))
    return str(tmp_path)


@pytest.mark.parametrize("mesh,blocks,ep", [("dp=1", 1, 1), ("dp=2", 2, 1), ("dp=1,ep=2", 2, 2)])
def test_a_plan_sizes_each_experts_buffer_by_its_even_share_and_says_so(tmp_path, capsys, monkeypatch, mesh, blocks,
                                                                         ep):
    """An expert's capacity is data (its busiest expert's tokens); a plan's meta trace has no values. It takes the
    even share of a rank's tokens, ceil(N x top-k / experts) rows an expert (it took a stand-in 1: the experts'
    activations were a token each), and prints what it assumed. A rank's rows are its block over dp x ep (ep is a
    data axis)."""
    from funcpar.cli import main as cli

    shapes = []
    experts = mixtral._experts
    monkeypatch.setattr(mixtral, "_experts", lambda p, x, m: shapes.append(tuple(x.shape)) or experts(p, x, m))
    cli.plan(["--model", _config_folder(tmp_path), "--mesh", mesh, "--global-batch", "4", "--seq-len", "100",
              "--gpu", "h100", "--precision", "bf16"])
    share = -(-4 // blocks * 100 * 2 // 8)  # (a rank's rows x tokens x top-k over the experts, rounded up)
    assert shapes and set(shapes) == {(8 // ep, ep * share, 64)}, shapes
    assert f"(assumed where the data decides: {mixtral.CAPACITY})" in capsys.readouterr().out


@pytest.mark.subprocess
def test_the_command_line_trains_on_an_ep_mesh_as_one_process(tmp_path):
    """ep is Mixtral's data axis (ModelSpec.data_axes): funcpar train splits the batch over dp x ep and sums over
    both, so ep=2 gives the one-process run's losses (its load-balancing loss included: output_router_logits) and
    gradient norms, the held-out loss too. (It used to split over dp alone: both ep ranks read the same rows,
    grad_norm 4.971 against 4.927 at step 1.)"""
    import json
    import subprocess
    import sys

    import transformers as tf

    assert mixtral.MODEL.data_axes == ("dp", "ep")
    torch.manual_seed(0)
    config = tf.MixtralConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                              num_experts_per_tok=2, max_position_embeddings=64, router_aux_loss_coef=0.02,
                              output_router_logits=True)
    tf.MixtralForCausalLM(config).save_pretrained(tmp_path / "model")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    rows = {}
    for mesh in ("1", "ep=2"):
        p = subprocess.run([sys.executable, "-m", "funcpar", "train", "--model", str(tmp_path / "model"),
                            "--tokenizer", "byte", "--schedule", "constant", "--mesh", mesh, "--global-batch", "4",
                            "--seq-len", "32", "--steps", "3", "--eval-every", "3", "--out", str(tmp_path / mesh)],
                           capture_output=True, text=True, timeout=600, env=env)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        rows[mesh] = [json.loads(x) for x in (tmp_path / mesh / "metrics.jsonl").read_text().splitlines()]
    assert len(rows["1"]) == len(rows["ep=2"]) == 3
    for one, ep in zip(rows["1"], rows["ep=2"], strict=True):
        for k in ("loss", "grad_norm", "eval_loss"):
            assert (k in one) == (k in ep), k
            if k in one:
                assert ep[k] == pytest.approx(one[k], rel=1e-5), (k, one, ep)
    assert "eval_loss" in rows["1"][-1]
