"""Baichuan2-7B's published checkpoint layout: q/k/v fused in ``W_pack``, the head normalised row by row in the
forward pass (NormHead), the embedding's pad row without gradient. transformers has no class for it, so the reference
is written here in plain torch from the published description; the folders are written with the published tensor
names and config.json keys (auto_map and tokenizer ids included). Logits, loss and gradients at Mesh(), tp=2 and
tp=4; byte-identical round trips (from one process and from tp=2); the layouts funcpar refuses, by their keys."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import funcpar as fp
import harness
from fixtures import baichuan_config

V, D, H, INTER, LAYERS = (baichuan_config()[k] for k in ("vocab_size", "hidden_size", "num_attention_heads",
                                                           "intermediate_size", "num_hidden_layers"))


def write_folder(folder, vocab=V, dtype=torch.float32, seed=0):
    """A Baichuan2-layout folder: random weights (norms away from 1, head rows of unequal norms) under the
    published names; returns the float32 tensors."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    sd = {"model.embed_tokens.weight": rand(vocab, D, scale=1.0), "model.norm.weight": 1 + rand(D),
          "lm_head.weight": rand(vocab, D) * (0.2 + torch.rand(vocab, 1, generator=g))}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": 1 + rand(D), p + "post_attention_layernorm.weight": 1 + rand(D),
               p + "self_attn.W_pack.weight": rand(3 * D, D, scale=0.2), p + "self_attn.o_proj.weight": rand(D, D),
               p + "mlp.gate_proj.weight": rand(INTER, D), p + "mlp.up_proj.weight": rand(INTER, D),
               p + "mlp.down_proj.weight": rand(D, INTER)}
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.to(dtype) for k, v in sd.items()}, os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})
    cfg = baichuan_config(vocab_size=vocab, torch_dtype=str(dtype).removeprefix("torch."))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return sd


# ------------------------------------------------------------------------------------ the reference, plain torch


def reference_logits(sd, ids, pad=0):
    """Baichuan2-7B's forward from its description: RMSNorm(eps 1e-6), rotary (base 10000, rotate-half), causal
    multi-head attention from W_pack's q, k, v row blocks, SwiGLU MLP, final RMSNorm, NormHead."""
    B, T = ids.shape
    hd = D // H

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(T).float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # (T, hd)

    def rope(t):  # (B, H, T, hd)
        return t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin

    causal = torch.full((T, T), float("-inf")).triu(1)
    x = F.embedding(ids, sd["model.embed_tokens.weight"], padding_idx=pad)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        qkv = rms(x, sd[p + "input_layernorm.weight"]) @ sd[p + "self_attn.W_pack.weight"].T  # (B, T, 3D)
        q, k, v = qkv.view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)  # each (B, H, T, hd)
        att = torch.softmax(rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(hd) + causal, dim=-1)
        x = x + (att @ v).transpose(1, 2).reshape(B, T, D) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        mlp = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ sd[p + "mlp.down_proj.weight"].T
    head = sd["lm_head.weight"]
    return rms(x, sd["model.norm.weight"]) @ (head / head.norm(dim=-1, keepdim=True)).T  # (B, T, V)


def reference_loss(logits, labels):
    """The published labels= loss with z_loss_weight 0: shifted cross-entropy, -100 ignored."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def reference_grads(sd, b):
    leaves = {k: v.clone().requires_grad_() for k, v in sd.items()}
    loss = reference_loss(reference_logits(leaves, b["input_ids"]), b["labels"])
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))


def as_hf(tree):
    """A funcpar Baichuan tree under the published names (W_pack = q, k, v rows)."""
    out = {"model.embed_tokens.weight": tree["embed"], "model.norm.weight": tree["norm"],
           "lm_head.weight": tree["lm_head"]}
    for i, lp in enumerate(tree["layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": lp["attn_norm"], p + "post_attention_layernorm.weight": lp["mlp_norm"],
                p + "self_attn.W_pack.weight": torch.cat([lp["wq"], lp["wk"], lp["wv"]]),
                p + "self_attn.o_proj.weight": lp["wo"], p + "mlp.gate_proj.weight": lp["w_gate"],
                p + "mlp.up_proj.weight": lp["w_up"], p + "mlp.down_proj.weight": lp["w_down"]}
    return out


def make_batch(vocab=V, seed=0, B=2, T=12):
    ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
    ids[1, 4] = 0  # the pad token (id 0) occurs: its embedding row must get no gradient
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("baichuan")
    out = {}
    for name, vocab, dtype in (("f32", V, torch.float32), ("bf16", V, torch.bfloat16), ("v100", 100, torch.float32)):
        sd = write_folder(str(root / name), vocab, dtype)
        out[name] = (str(root / name), sd, make_batch(vocab))
    return out


# ------------------------------------------------------------------------------------------------ one process


def test_logits_loss_and_gradients_match_the_reference(folders):
    path, sd, b = folders["f32"]
    params, cfg = fp.hf.load(path)
    model = fp.get_model("baichuan")
    assert cfg.model_type == "baichuan" and model.name == "baichuan"
    ref = reference_logits(sd, b["input_ids"])
    logits = model.forward(params, b["input_ids"], cfg, fp.Mesh())
    assert logits.shape == (2, 12, V)
    assert (logits - ref).abs().max().item() <= 1e-5
    loss = model.loss(params, b, cfg=cfg, mesh=fp.Mesh())
    ref_loss = reference_loss(ref, b["labels"])
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * ref_loss.item()
    # without the normalisation the logits would differ: the head rows' norms are far from 1
    assert (sd["lm_head.weight"].norm(dim=-1) - 1).abs().max() > 0.3

    grads = as_hf(torch.func.grad(lambda p: model.loss(p, b, cfg=cfg, mesh=fp.Mesh()))(params))
    ref_grads = reference_grads(sd, b)
    assert sorted(grads) == sorted(ref_grads)
    for name, r in ref_grads.items():
        err = (grads[name] - r).abs().max().item()
        assert err <= 1e-5 * r.abs().max().item(), (name, err)
    assert (b["input_ids"] == 0).any() and grads["model.embed_tokens.weight"][0].abs().max() == 0
    assert b["input_ids"][0, 0] != 0 and grads["model.embed_tokens.weight"][b["input_ids"][0, 0]].abs().max() > 0


def test_staged_and_rematerialised_losses_equal_the_loss(folders):
    path, _, b = folders["f32"]
    params, cfg = fp.hf.load(path)
    model = fp.get_model("baichuan")
    mesh = fp.Mesh()
    loss = model.loss(params, b, cfg=cfg, mesh=mesh)
    assert torch.equal(model.stages.loss(params, b, cfg, mesh), loss)
    g = torch.func.grad(lambda p: model.loss(p, b, cfg=cfg, mesh=mesh))(params)
    g_remat = torch.func.grad(lambda p: model.loss(p, b, cfg=cfg, mesh=mesh, remat=True))(params)
    for (name, x), (_, y) in zip(fp.tree.leaves_with_path(g), fp.tree.leaves_with_path(g_remat), strict=True):
        assert (x - y).abs().max().item() <= 1e-6 * x.abs().max().item() + 1e-12, name


# --------------------------------------------------------------------------------------------- tensor parallel


def _on_meshes(plans):
    """On each rank of a 4-process world, for each (mesh sizes, jobs, exports) of ``plans``: (local logits, loss,
    gradients gathered on rank 0) for each (folder, batch) of ``jobs``, and each (folder, out) of ``exports``
    imported and exported from that mesh."""
    model = fp.get_model("baichuan")
    out = []
    for sizes, jobs, exports in plans:
        mesh = harness.mesh(**sizes)
        results = []
        for path, b in jobs:
            params, cfg = fp.hf.load(path, mesh=mesh)
            logits = model.forward(params, b["input_ids"], cfg, mesh)
            loss = model.loss(params, b, cfg=cfg, mesh=mesh)
            grads = torch.func.grad(lambda p: model.loss(p, b, cfg=cfg, mesh=mesh))(params)
            results.append((logits, loss, fp.gather(grads, model.specs(cfg, mesh), mesh, dst=0)))
        for path, dst in exports:
            params, cfg = fp.hf.load(path, mesh=mesh)
            fp.hf.save(dst, params, model, cfg, mesh)
        out.append(results)
    return out


@pytest.fixture(scope="module")
def sharded(folders, tmp_path_factory):
    """tp=2 (as Mesh(tp=2, dp=2): ranks 0 and 1 are the first tp group) and tp=4, on one 4-process world."""
    export = str(tmp_path_factory.mktemp("baichuan-exports") / "bf16-tp2")
    f32, v100 = folders["f32"], folders["v100"]
    ranks = harness.run(4, _on_meshes, [({"tp": 2, "dp": 2}, [f32[0::2]], [(folders["bf16"][0], export)]),
                                        ({"tp": 4}, [f32[0::2], v100[0::2]], [])])
    return {2: [r[0] for r in ranks[:2]], 4: [r[1] for r in ranks], "export": export}


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_logits_and_loss_match_the_reference(folders, sharded, tp):
    for job, name in enumerate(["f32", "v100"] if tp == 4 else ["f32"]):
        _, sd, b = folders[name]
        vocab = sd["lm_head.weight"].shape[0]
        ref = reference_logits(sd, b["input_ids"])
        ref_loss = reference_loss(ref, b["labels"]).item()
        ranks = [r[job] for r in sharded[tp]]
        logits = torch.cat([logits for logits, _, _ in ranks], dim=-1)  # the vocabulary blocks in tp order
        assert ranks[0][0].shape[-1] == 128 // tp and logits.shape[-1] == vocab, (name, tp)
        assert (logits - ref).abs().max().item() <= 1e-5, (name, tp)
        for _, loss, _ in ranks:
            assert abs(loss.item() - ref_loss) <= 1e-6 * ref_loss, (name, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_gradients_equal_one_process(folders, sharded, tp):
    path, _, b = folders["f32"]
    params, cfg = fp.hf.load(path)
    model = fp.get_model("baichuan")
    ref = torch.func.grad(lambda p: model.loss(p, b, cfg=cfg, mesh=fp.Mesh()))(params)
    got = sharded[tp][0][0][2]
    assert [r[0][2] for r in sharded[tp][1:]] == [None] * (tp - 1)  # gathered on rank 0 only
    got, ref = fp.tree.leaves_with_path(got), fp.tree.leaves_with_path(ref)
    assert [name for name, _ in got] == [name for name, _ in ref]
    for (name, g), (_, r) in zip(got, ref, strict=True):
        assert g.shape == r.shape, name
        err = (g - r).abs().max().item()
        assert err <= 1e-5 * r.abs().max().item(), (tp, name, err)


def test_padded_vocabulary_gradients_are_finite_and_padding_rows_stay_zero(sharded):
    _, _, grads = sharded[4][0][1]  # vocab 100 on tp=4: 128 rows, 28 of them padding, all on the last rank
    for name, g in fp.tree.leaves_with_path(grads):
        assert torch.isfinite(g).all(), name
    assert grads["lm_head"][100:].abs().max() == 0 and grads["embed"][100:].abs().max() == 0


# ------------------------------------------------------------------------------------------------- round trips


def _assert_same_folder(src, out):
    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        assert json.load(f) == json.load(g)


def test_import_export_is_byte_identical(folders, tmp_path):
    for name in ("bf16", "f32"):  # bfloat16 as published; float32
        path, _, _ = folders[name]
        params, cfg = fp.hf.load(path)
        assert {x.dtype for _, x in fp.tree.leaves_with_path(params)} == {
            torch.bfloat16 if name == "bf16" else torch.float32}
        fp.hf.save(tmp_path / name, params, fp.get_model("baichuan"), cfg)
        _assert_same_folder(path, str(tmp_path / name))


def test_export_from_tensor_parallel_is_byte_identical(folders, sharded):
    _assert_same_folder(folders["bf16"][0], sharded["export"])


def test_the_published_7b_config_round_trips():
    src = baichuan_config(vocab_size=125696, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, max_position_embeddings=4096, model_max_length=4096,
                          torch_dtype="bfloat16")
    model = fp.get_model("baichuan")
    cfg = model.config(src, fp.Mesh())
    assert cfg.head_dim == 128 and cfg.rows == 125696 and cfg.to_hf() == src
    shapes = model.init(cfg, device="meta")
    assert shapes["layers"][0]["wq"].shape == (4096, 4096) and shapes["lm_head"].shape == (125696, 4096)


# ------------------------------------------------------------------------------------------------ what is refused


THIRTEEN_B = dict(hidden_size=5120, intermediate_size=13696, num_hidden_layers=40, num_attention_heads=40,
                  vocab_size=125696)


@pytest.mark.parametrize("edits, match", [
    # the published 13B config.json: no max_position_embeddings (its positions are ALiBi biases)
    ({**THIRTEEN_B, "max_position_embeddings": None}, r"'max_position_embeddings'.*13B.*ALiBi"),
    # 13B sizes even where someone added the key
    (THIRTEEN_B, r"5120, 40, 40.*13B.*ALiBi"),
    ({"z_loss_weight": 1e-4}, r"'z_loss_weight' is 0\.0001"),
    ({"architectures": ["BaiChuanForCausalLM"]}, r"BaiChuanForCausalLM.*Baichuan 1 7B"),
    ({"tie_word_embeddings": True}, r"tie_word_embeddings"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
    ({"pad_token_id": 128}, r"pad_token_id=128"),
])
def test_unsupported_layouts_are_refused_by_key(tmp_path, edits, match):
    cfg = baichuan_config(**edits)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(fp.hf.HFError, match=match) as e:
        fp.hf.load(tmp_path)
    assert "config.json" in str(e.value)


def test_a_tp_that_does_not_divide_the_heads_is_refused():
    model, mesh = fp.get_model("baichuan"), fp.Mesh.abstract(tp=3)
    cfg = model.config(baichuan_config(), mesh)  # the vocabulary padded to 384 rows: tp=3 divides them
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tp=3: tensor parallelism splits "
                                         r"attention by whole heads \(use tp=1, 2 or 4\)"):
        model.specs(cfg, mesh)
