"""ChatGLM3-6B–style folders (model_type "chatglm") imported as transformers' GLM, exact against GlmForCausalLM.

A tiny GlmForCausalLM (4 query heads in 2 kv groups, kv_channels 8, q/k/v bias, rope_ratio 2.5) is written under
ChatGLM3's names: q, k and v fused into one query_key_value of unequal parts (32 + 16 + 16 rows), gate and up into
dense_h_to_4h, a rotary buffer to ignore, and a chatglm config.json. A reference written from ChatGLM3's modelling
code (modeling_chatglm.py) on those tensors gives transformers' logits, so the folder means what the GLM model
computes; funcpar imports it at Mesh() and at tp=2 (each rank reading only its rows of each part), exports it as a
GLM folder that GlmForCausalLM loads, and refuses by key the configs whose layout does not map.
"""

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import funcpar as fp
import harness
from funcpar.models import chatglm, glm
from hf_fixtures import assert_identical, checkpoint_tensors

tf = pytest.importorskip("transformers")

HEADS, GROUPS, KV, HIDDEN, FFN, LAYERS, VOCAB, RATIO = 4, 2, 8, 32, 48, 2, 100, 2.5
DROP = "(the key left out)"


def chatglm_config():
    """config.json as ChatGLM3-6B publishes it (its keys and flags), at a tiny size."""
    return dict(
        model_type="chatglm", architectures=["ChatGLMModel"], num_layers=LAYERS, padded_vocab_size=VOCAB,
        hidden_size=HIDDEN, ffn_hidden_size=FFN, kv_channels=KV, num_attention_heads=HEADS,
        multi_query_attention=True, multi_query_group_num=GROUPS, seq_length=64, layernorm_epsilon=1e-5,
        rmsnorm=True, add_qkv_bias=True, add_bias_linear=False, apply_residual_connection_post_layernorm=False,
        post_layer_norm=True, original_rope=True, rope_ratio=RATIO, fp32_residual_connection=False,
        apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True, bias_dropout_fusion=True,
        hidden_dropout=0.0, attention_dropout=0.0, quantization_bit=0, pre_seq_len=None, prefix_projection=False,
        tie_word_embeddings=False, eos_token_id=2, pad_token_id=0, torch_dtype="float32", use_cache=True,
    )


def chatglm_tensors(model):
    """A GlmForCausalLM's weights under ChatGLM3's names (the inverse of the mapping funcpar reads)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {"transformer.embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "transformer.encoder.final_layernorm.weight": sd["model.norm.weight"],
           "transformer.output_layer.weight": sd["lm_head.weight"],
           "transformer.rotary_pos_emb.inv_freq": 1.0 / (10000 ** (torch.arange(0, KV // 2, 2).float() / (KV // 2)))}
    for i in range(LAYERS):
        g, c = f"model.layers.{i}.", f"transformer.encoder.layers.{i}."
        gate, up = sd[g + "mlp.gate_up_proj.weight"].chunk(2)
        out |= {
            c + "input_layernorm.weight": sd[g + "input_layernorm.weight"],
            c + "post_attention_layernorm.weight": sd[g + "post_attention_layernorm.weight"],
            c + "self_attention.dense.weight": sd[g + "self_attn.o_proj.weight"],
            c + "mlp.dense_h_to_4h.weight": torch.cat([gate, up]),
            c + "mlp.dense_4h_to_h.weight": sd[g + "mlp.down_proj.weight"],
        }
        for kind in ("weight", "bias"):
            out[c + f"self_attention.query_key_value.{kind}"] = torch.cat(
                [sd[g + f"self_attn.{x}_proj.{kind}"] for x in "qkv"])
    return {k: v.contiguous() for k, v in out.items()}


def chatglm_reference(t, c, ids):
    """Logits as ChatGLM3's modelling code computes them (float32, no cache), from its tensors and config."""
    B, T = ids.shape
    heads, groups, hn = c["num_attention_heads"], c["multi_query_group_num"], c["kv_channels"]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["layernorm_epsilon"]))

    n_elem = hn // 2  # RotaryEmbedding(rotary_dim // 2), base 10000 * rope_ratio
    theta = 1.0 / ((10000 * c["rope_ratio"]) ** (torch.arange(0, n_elem, 2, dtype=torch.float) / n_elem))
    angles = torch.outer(torch.arange(T, dtype=torch.float), theta)
    cache = torch.stack([angles.cos(), angles.sin()], -1)  # (T, rot/2, 2)

    def rope(x):  # apply_rotary_pos_emb on (B, T, H, hn): adjacent pairs of the first rot dims
        rot = cache.shape[-2] * 2
        x, rest = x[..., :rot], x[..., rot:]
        xs, rc = x.reshape(B, T, -1, rot // 2, 2), cache.view(1, T, 1, rot // 2, 2)
        out = torch.stack([xs[..., 0] * rc[..., 0] - xs[..., 1] * rc[..., 1],
                           xs[..., 1] * rc[..., 0] + xs[..., 0] * rc[..., 1]], -1)
        return torch.cat((out.flatten(3), rest), -1)

    def expand(x):  # (B, T, G, hn) -> (B, T, H, hn): query head j uses group j // (H / G)
        return x.unsqueeze(3).expand(-1, -1, -1, heads // groups, -1).reshape(B, T, heads, hn)

    x = t["transformer.embedding.word_embeddings.weight"][ids]
    for i in range(c["num_layers"]):
        p = {k.split(f"layers.{i}.", 1)[1]: v for k, v in t.items() if f".layers.{i}." in k}
        h = rms(x, p["input_layernorm.weight"])
        qkv = F.linear(h, p["self_attention.query_key_value.weight"], p["self_attention.query_key_value.bias"])
        q, k, v = qkv.split([heads * hn, groups * hn, groups * hn], -1)
        q, k, v = q.view(B, T, heads, hn), k.view(B, T, groups, hn), v.view(B, T, groups, hn)
        q, k, v = rope(q), expand(rope(k)), expand(v)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + F.linear(o.transpose(1, 2).reshape(B, T, heads * hn), p["self_attention.dense.weight"])
        gate, up = F.linear(rms(x, p["post_attention_layernorm.weight"]), p["mlp.dense_h_to_4h.weight"]).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, p["mlp.dense_4h_to_h.weight"])
    return F.linear(rms(x, t["transformer.encoder.final_layernorm.weight"]), t["transformer.output_layer.weight"])


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatglm3")
    c = chatglm_config()
    torch.manual_seed(0)
    model = tf.GlmForCausalLM(tf.GlmConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=KV, max_position_embeddings=64,
        rms_norm_eps=1e-5, attention_bias=True, pad_token_id=None, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0 * RATIO, "partial_rotary_factor": 0.5},
    )).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(root / "glm")
    os.makedirs(root / "chatglm")
    save_file(chatglm_tensors(model), str(root / "chatglm" / "model.safetensors"), metadata={"format": "pt"})
    (root / "chatglm" / "config.json").write_text(json.dumps(c))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    with torch.no_grad():
        out = model(**batch)
    return dict(path=str(root / "chatglm"), glm=str(root / "glm"), model=model, logits=out.logits,
                loss=out.loss.item(), batch=batch)


def test_the_chatglm_folder_means_what_transformers_glm_computes(ref):
    """The test's own premise: ChatGLM3's computation on the written tensors is the GLM model's."""
    got = chatglm_reference(checkpoint_tensors(ref["path"]), chatglm_config(), ref["batch"]["input_ids"])
    assert (got - ref["logits"]).abs().max().item() <= 1e-5


def test_config_maps_onto_glm():
    cfg = chatglm.MODEL.config(chatglm_config())
    assert type(cfg) is glm.Config and cfg.model_type == "glm" and fp.get_model(cfg.model_type) is glm.MODEL
    assert (cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim,
            cfg.rope_theta, cfg.attention_bias, cfg.pad_token_id, cfg.tie_word_embeddings) == (
        VOCAB, HEADS, GROUPS, KV, KV // 2, 10000.0 * RATIO, True, None, False)
    hf = tf.GlmConfig.from_dict(cfg.to_hf())  # what GlmForCausalLM.from_pretrained reads from the export
    assert (hf.rope_parameters["rope_theta"], hf.rope_parameters["partial_rotary_factor"], hf.head_dim,
            hf.num_key_value_heads, hf.intermediate_size, hf.pad_token_id, hf.eos_token_id) == (
        10000.0 * RATIO, 0.5, KV, GROUPS, FFN, None, 2)
    # absent keys mean ChatGLMConfig's defaults (rope_ratio 1: theta 10000)
    c = {k: v for k, v in chatglm_config().items() if k not in ("rope_ratio", "original_rope", "pre_seq_len")}
    assert chatglm.MODEL.config(c).rope_theta == 10000.0


def test_mesh_logits_and_loss_match_transformers(ref):
    params, cfg = fp.hf.load(ref["path"])
    assert fp.get_model(cfg.model_type) is glm.MODEL
    mesh = fp.Mesh()
    logits = glm.forward(params, ref["batch"]["input_ids"], cfg, mesh)
    assert logits.shape == ref["logits"].shape
    assert (logits - ref["logits"]).abs().max().item() <= 1e-5
    assert abs(glm.loss(params, ref["batch"], cfg, mesh).item() - ref["loss"]) <= 1e-5 * ref["loss"]
    glm_params, glm_cfg = fp.hf.load(ref["glm"])  # the same leaves as transformers' own GLM folder, bit for bit
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(fp.tree.leaves_with_path(params),
                                                          fp.tree.leaves_with_path(glm_params), strict=True))


def test_export_is_a_glm_folder_transformers_loads(ref, tmp_path):
    params, cfg = fp.hf.load(ref["path"])
    fp.hf.save(tmp_path / "out", params, chatglm.MODEL, cfg)  # written as GLM, whichever of the two is passed
    assert_identical(checkpoint_tensors(ref["glm"]), checkpoint_tensors(tmp_path / "out"))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == "glm" and written["architectures"] == ["GlmForCausalLM"]
    assert "num_layers" not in written and written["pad_token_id"] is None
    model = tf.GlmForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (model(input_ids=ref["batch"]["input_ids"]).logits - ref["logits"]).abs().max().item() <= 1e-6
    again, cfg2 = fp.hf.load(tmp_path / "out")
    assert cfg2 == cfg


def _on_tp2(path, batch, export):
    mesh = harness.mesh(tp=2)
    stats = {}
    params, cfg = fp.hf.load(path, mesh=mesh, stats=stats)
    own = 0  # the bytes of this rank's blocks, less the vocabulary's tp padding rows (zeros, in no file)
    for path, _, x in fp.spec.broadcast_specs(glm.specs(cfg, mesh), params):
        rows = x.shape[0]
        if path in ("embed", "lm_head"):
            rows = min(rows, max(0, cfg.vocab_size - mesh.coord("tp") * rows))
        own += rows * x[0].numel() * x.element_size()
    logits = glm.forward(params, batch["input_ids"], cfg, mesh)
    loss = glm.loss(params, batch, cfg, mesh).item()
    fp.hf.save(export, params, chatglm.MODEL, cfg, mesh)
    return logits, loss, stats["bytes_read"], own, cfg.rows, params["layers"]


def test_tensor_parallel_reads_only_its_rows_and_matches_transformers(ref, tmp_path):
    export = str(tmp_path / "tp2")
    results = harness.run(2, _on_tp2, ref["path"], ref["batch"], export)
    logits = torch.cat([r[0] for r in results], dim=-1)  # vocab blocks in tp order
    assert (logits - ref["logits"]).abs().max().item() <= 1e-5
    sd = ref["model"].state_dict()
    for rank, (_, loss, read, own, rows, layers) in enumerate(results):
        assert abs(loss - ref["loss"]) <= 1e-5 * ref["loss"]
        assert read == own, (rank, read, own)  # exactly its blocks
        assert rows == 128  # 100 tokens padded for tp: rank 1 reads 36 rows of the tables, not 64
        for i, lp in enumerate(layers):  # its heads' rows of q, then of k, then of v, out of query_key_value
            g = f"model.layers.{i}."
            gate, up = sd[g + "mlp.gate_up_proj.weight"].chunk(2)
            want = {"wq": sd[g + "self_attn.q_proj.weight"], "wk": sd[g + "self_attn.k_proj.weight"],
                    "wv": sd[g + "self_attn.v_proj.weight"], "bq": sd[g + "self_attn.q_proj.bias"],
                    "bk": sd[g + "self_attn.k_proj.bias"], "bv": sd[g + "self_attn.v_proj.bias"],
                    "w_gate": gate, "w_up": up}
            for name, whole in want.items():
                n = whole.shape[0] // 2
                assert torch.equal(lp[name], whole[rank * n:(rank + 1) * n]), (rank, i, name)
    assert_identical(checkpoint_tensors(ref["glm"]), checkpoint_tensors(export))  # exported from the mesh as GLM: the same bytes


@pytest.mark.parametrize("edit, message", [
    ({"apply_residual_connection_post_layernorm": True},
     r"config key 'apply_residual_connection_post_layernorm' is True: only False maps"),
    ({"rmsnorm": False}, r"config key 'rmsnorm' is False: only True maps .*LayerNorm"),
    ({"post_layer_norm": False}, r"config key 'post_layer_norm' is False: only True maps"),
    ({"add_bias_linear": True}, r"config key 'add_bias_linear' is True: only False maps .*biases"),
    ({"multi_query_attention": False}, r"config key 'multi_query_attention' is False: .*interleaved head by head"),
    ({"multi_query_attention": DROP}, r"config key 'multi_query_attention' is False \(absent: ChatGLMConfig's"),
    ({"multi_query_group_num": 3}, r"config key 'multi_query_group_num' is 3: num_attention_heads=4 is not a"),
    ({"kv_channels": 6}, r"config key 'kv_channels' is 6: .*multiple of 4"),
    ({"rope_ratio": 0}, r"config key 'rope_ratio' is 0: expected a positive number"),
    ({"pre_seq_len": 16}, r"config key 'pre_seq_len' is 16: only None maps .*prefix encoder"),
    ({"quantization_bit": 4}, r"config key 'quantization_bit' is 4: only 0 maps"),
    ({"fp32_residual_connection": True}, r"config key 'fp32_residual_connection' is True"),
    ({"tie_word_embeddings": True}, r"config key 'tie_word_embeddings' is True: .*never ties"),
    ({"hidden_dropout": 0.1}, r"config key 'hidden_dropout' is 0.1: .*no dropout"),
    ({"num_layers": DROP}, r"config key 'num_layers' is missing"),
    ({"rmsnorm": "false"}, r"config key 'rmsnorm' is 'false' \(a string\), expected true or false"),
])
def test_configs_that_do_not_map_are_refused_by_key(edit, message):
    d = {k: v for k, v in (chatglm_config() | edit).items() if v is not DROP}
    with pytest.raises(ValueError, match=message):
        chatglm.MODEL.config(d)


def test_a_refused_folder_names_its_config_file(ref, tmp_path):
    folder = tmp_path / "ln"
    os.makedirs(folder)
    os.link(os.path.join(ref["path"], "model.safetensors"), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(chatglm_config() | {"rmsnorm": False}))
    with pytest.raises(fp.hf.HFError, match=r"ln/config.json: config key 'rmsnorm' is False"):
        fp.hf.load(folder)


def test_a_split_table_whose_parts_do_not_add_up_is_named():
    cfg = chatglm.MODEL.config(chatglm_config())
    broken = dataclasses.replace(chatglm.MODEL, hf=dataclasses.replace(
        chatglm.HF, splits={**chatglm.HF.splits, "layers.{i}.wv": (0, 1, 3)}))  # k and v both part 1 of 3
    with pytest.raises(fp.hf.HFError, match=r"query_key_value.weight' of 3 parts, but its leaves give parts \[0, 1\]"):
        fp.hf.name_plan(broken, ["layers.0.wq"], cfg)
