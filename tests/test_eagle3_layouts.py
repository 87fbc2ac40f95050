"""EAGLE-3 heads in SpecForge's and speculators' layouts (``candidate_generators/eagle3/layouts.py``).

The checkpoints here are written by the tests themselves, key by key and field by field, from the
names the two projects use, not by ``save_head``: SpecForge's draft module
(specforge/modeling/draft/llama3_eagle.py: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, buffers
``d2t`` int64 and ``t2d`` bool; config as configs/llama3-8B-eagle3.json and, with
``eagle_config``, configs/gpt-oss-20B-eagle3.json), and speculators' Eagle3 draft
(src/speculators/models/eagle3/{core,config,model_definitions}.py: ``layers.0.*`` for the layer,
``transformer_layer_config``, top-level ``eagle_aux_hidden_state_layer_ids``). Loading them must
give every tensor back under the module's names, aux layers converted to ``output_hidden_states``
numbering (SpecForge id ``i`` -> ``i + 1``, speculators id unchanged), and the vocabulary maps;
``save_head`` round-trips in both layouts; every refusal names what is wrong.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig

from candidate_generators.eagle3.head import Eagle3Head, HeadConfig
from candidate_generators.eagle3.layouts import (check_fit, hidden_to_specforge, load_head, read_config,
                                                 save_head, specforge_to_hidden)

H, I, HEADS, KV, HD, VOCAB, DRAFT, LAYERS = 32, 64, 4, 2, 8, 128, 48, 6


def target(**overrides) -> LlamaConfig:
    fields = dict(hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV, vocab_size=VOCAB)
    return LlamaConfig(**{**fields, **overrides})


def draft_ids(draft: int = DRAFT) -> torch.Tensor:
    """The target ids of the draft vocabulary, ascending (as SpecForge builds d2t)."""
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))[:draft].sort().values


def tensors(prefix: str, draft: int = DRAFT, embed: bool = True, maps: bool = True, seed: int = 0) -> dict:
    """A head's checkpoint with its layer under ``prefix`` ("midlayer." or "layers.0.")."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    state = {
        "fc.weight": rand(H, 3 * H),
        f"{prefix}self_attn.q_proj.weight": rand(HEADS * HD, 2 * H),
        f"{prefix}self_attn.k_proj.weight": rand(KV * HD, 2 * H),
        f"{prefix}self_attn.v_proj.weight": rand(KV * HD, 2 * H),
        f"{prefix}self_attn.o_proj.weight": rand(H, HEADS * HD),
        f"{prefix}mlp.gate_proj.weight": rand(I, H),
        f"{prefix}mlp.up_proj.weight": rand(I, H),
        f"{prefix}mlp.down_proj.weight": rand(H, I),
        f"{prefix}input_layernorm.weight": rand(H),
        f"{prefix}hidden_norm.weight": rand(H),
        f"{prefix}post_attention_layernorm.weight": rand(H),
        "norm.weight": rand(H),
        "lm_head.weight": rand(draft, H),
    }
    if maps:
        ids = draft_ids(draft)
        state["d2t"] = ids - torch.arange(draft)  # draft id d is target id d + d2t[d]
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    if embed:
        state["embed_tokens.weight"] = rand(VOCAB, H)
    return state


def specforge_config(ids=(0, 2, 4), draft: int = DRAFT, **overrides) -> dict:
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": H, "intermediate_size": I, "num_attention_heads": HEADS, "num_key_value_heads": KV,
              "num_hidden_layers": 1, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
              "vocab_size": VOCAB, "draft_vocab_size": draft}
    if ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids)}
    return {**config, **overrides}


def speculators_config(ids=(1, 3, 5), draft: int = DRAFT, verifier=("LlamaForCausalLM",), **overrides) -> dict:
    layer = {"model_type": "llama", "hidden_act": "silu", "hidden_size": H, "intermediate_size": I,
             "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD, "num_hidden_layers": 1,
             "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "vocab_size": VOCAB}
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "speculators_version": "0.3.0", "transformer_layer_config": layer, "draft_vocab_size": draft,
              "target_hidden_size": None, "norm_before_residual": False,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "some/llama", "architectures": list(verifier)}}}
    if ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(ids)
    return {**config, **overrides}


def write(folder, config: dict, state: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def module_name(name: str) -> str:
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def assert_holds(head: Eagle3Head, state: dict) -> None:
    """Every tensor of the checkpoint (bar the embeddings) is the head's, under the module's name."""
    mine = head.state_dict()
    stored = {module_name(k): v for k, v in state.items() if k != "embed_tokens.weight"}
    assert set(mine) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(mine[name], tensor.to(mine[name].dtype)), name


# -- loading each layout ------------------------------------------------------------------------------
def test_a_specforge_checkpoint_loads_by_name(tmp_path):
    state = tensors("midlayer.")
    head = load_head(write(tmp_path / "h", specforge_config(), state), target())
    assert_holds(head, state)
    assert head.config.aux_layers == (1, 3, 5)  # SpecForge ids 0, 2, 4 are the outputs of those layers
    assert head.config.rope_theta == 500000.0 and head.config.rms_norm_eps == 1e-5
    assert torch.equal(head.target_ids(torch.arange(DRAFT)), draft_ids())
    assert head.t2d.dtype == torch.bool and int(head.t2d.sum()) == DRAFT
    assert head.config.target_model_type == "llama"  # SpecForge records none: the target's is taken


def test_a_speculators_checkpoint_loads_by_name(tmp_path):
    state = tensors("layers.0.")
    head = load_head(write(tmp_path / "h", speculators_config(), state), target())
    assert_holds(head, state)
    assert head.config.aux_layers == (1, 3, 5)  # vLLM's ids are output_hidden_states indices already
    assert head.config.target_model_type == "llama"  # from the verifier's LlamaForCausalLM
    assert torch.equal(head.target_ids(torch.arange(DRAFT)), draft_ids())


def test_both_numberings_name_the_hidden_states_transformers_returns():
    """SGLang and vLLM capture the stream entering layer j; SpecForge id i is the output of layer i.
    In transformers' output_hidden_states, index j is what enters layer j (so SpecForge i -> i + 1)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(target()).eval()
    entering, leaving = {}, {}
    hooks = []
    for j, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, kw, j=j: entering.__setitem__(j, (kw.get(
            "hidden_states") if "hidden_states" in kw else a[0]).clone()), with_kwargs=True))
        hooks.append(layer.register_forward_hook(lambda m, a, out, j=j: leaving.__setitem__(
            j, (out[0] if isinstance(out, tuple) else out).clone())))
    with torch.no_grad():
        hidden = model(torch.arange(5)[None], output_hidden_states=True).hidden_states
    for hook in hooks:
        hook.remove()
    for j in range(LAYERS):
        assert torch.equal(hidden[j], entering[j])  # vLLM/speculators id j
    for i in range(LAYERS - 1):  # the last one's output reaches hidden_states after the final norm
        assert torch.equal(hidden[specforge_to_hidden([i])[0]], leaving[i])  # SpecForge/SGLang id i
    assert hidden_to_specforge(specforge_to_hidden([0, 2, 4])) == [0, 2, 4]


def test_absent_ids_take_the_serving_default(tmp_path):
    """SpecForge [1, n//2 - 1, n - 4] (+1) and vLLM [2, n//2, n - 3] are the same hidden states."""
    deep = target(num_hidden_layers=12)
    spec = load_head(write(tmp_path / "sf", specforge_config(ids=None), tensors("midlayer.")), deep)
    vllm = load_head(write(tmp_path / "sp", speculators_config(ids=None), tensors("layers.0.")), deep)
    assert spec.config.aux_layers == vllm.config.aux_layers == (2, 6, 9) == specforge_to_hidden([1, 5, 8])
    with pytest.raises(ValueError, match="target_config"):
        read_config(tmp_path / "sf")


def test_a_top_level_id_list_is_vllms_numbering(tmp_path):
    folder = write(tmp_path / "h", specforge_config(ids=None, eagle_aux_hidden_state_layer_ids=[1, 3, 5]),
                   tensors("midlayer."))
    assert read_config(folder).aux_layers == (1, 3, 5)
    write(folder, specforge_config(ids=[1, 3, 5], eagle_aux_hidden_state_layer_ids=[1, 3, 5]), tensors("midlayer."))
    with pytest.raises(ValueError, match="disagrees"):
        read_config(folder)


# -- vocabulary maps ------------------------------------------------------------------------------------
def test_a_full_vocabulary_without_maps_is_the_identity(tmp_path):
    state = tensors("layers.0.", draft=VOCAB, maps=False)  # speculators saves no maps then
    head = load_head(write(tmp_path / "h", speculators_config(draft=VOCAB), state), target())
    assert torch.equal(head.d2t, torch.zeros(VOCAB, dtype=torch.long)) and bool(head.t2d.all())


def test_a_reduced_vocabulary_without_maps_is_refused(tmp_path):
    folder = write(tmp_path / "h", specforge_config(), tensors("midlayer.", maps=False))
    with pytest.raises(ValueError, match="lacks d2t and t2d"):
        load_head(folder, target())


def test_t2d_follows_from_d2t_alone(tmp_path):
    state = tensors("midlayer.")
    t2d = state.pop("t2d")
    head = load_head(write(tmp_path / "h", specforge_config(), state), target())
    assert torch.equal(head.t2d, t2d)


@pytest.mark.parametrize("config, prefix, message", [
    (specforge_config(ids=(-1, 2, 4)), "midlayer.", "eagle_config.eagle_aux_hidden_state_layer_ids"),
    (speculators_config(ids=(0.5, 3, 5)), "layers.0.", "eagle_aux_hidden_state_layer_ids=.0.5"),
])
def test_layer_ids_that_are_not_whole_numbers_from_0_are_refused(tmp_path, config, prefix, message):
    """SpecForge's -1 loaded as the embeddings (a head save_head then refused); 0.5 was truncated."""
    with pytest.raises(ValueError, match=message):
        load_head(write(tmp_path / "h", config, tensors(prefix)), target())


def test_a_vocabulary_map_of_floats_is_refused(tmp_path):
    state = tensors("midlayer.")
    state["d2t"] = state["d2t"].float() + 0.25
    with pytest.raises(ValueError, match="d2t is torch.float32; a vocabulary map holds whole numbers"):
        load_head(write(tmp_path / "h", specforge_config(), state), target())


def test_weights_of_an_integer_dtype_are_refused_naming_them(tmp_path):
    """torch's own error came back (once per parameter, naming no dtype); with fc.weight alone in
    int8, every weight was cast to int8."""
    state = tensors("midlayer.")
    state["fc.weight"] = state["fc.weight"].to(torch.int8)
    with pytest.raises(ValueError, match="fc.weight is torch.int8; a head's weights are floating point"):
        load_head(write(tmp_path / "h", specforge_config(), state), target())


def test_maps_that_disagree_are_refused(tmp_path):
    state = tensors("midlayer.")
    state["t2d"] = ~state["t2d"]
    with pytest.raises(ValueError, match="t2d"):
        load_head(write(tmp_path / "h", specforge_config(), state), target())


# -- saving ---------------------------------------------------------------------------------------------
def random_head(dtype=torch.float32) -> Eagle3Head:
    torch.manual_seed(3)
    head = Eagle3Head(HeadConfig.for_target(target(), draft_vocab_size=DRAFT, aux_layers=(1, 3, 5)))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_()
    head.set_vocab(draft_ids())
    return head.to(dtype)


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_save_head_round_trips(tmp_path, layout):
    head = random_head()
    save_head(head, tmp_path / "h", layout)
    back = load_head(tmp_path / "h", target())
    assert back.config == head.config and back.config.rope_scaling == head.config.rope_scaling
    for name, tensor in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_saved_files_use_each_layouts_names(tmp_path):
    head = random_head()
    save_head(head, tmp_path / "sf", "specforge")
    save_head(head, tmp_path / "sp", "speculators", verifier="some/llama")
    sf, sp = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("sf", "sp"))
    assert sf["architectures"] == ["LlamaForCausalLMEagle3"] and sf["num_hidden_layers"] == 1
    assert sf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert (sf["vocab_size"], sf["draft_vocab_size"], sf["tie_word_embeddings"]) == (VOCAB, DRAFT, False)
    assert sp["speculators_model_type"] == "eagle3" and sp["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert sp["norm_before_residual"] is False and sp["transformer_layer_config"]["model_type"] == "llama"
    assert sp["speculators_config"]["verifier"] == {"name_or_path": "some/llama", "architectures": ["LlamaForCausalLM"]}
    assert sp["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3  # vLLM requires it
    sf_keys, sp_keys = (set(load_file(str(tmp_path / d / "model.safetensors"))) for d in ("sf", "sp"))
    assert sf_keys == set(tensors("midlayer.", embed=False))
    assert sp_keys == set(tensors("layers.0.", embed=False))


def test_dtype_is_the_checkpoints_unless_asked(tmp_path):
    save_head(random_head(torch.bfloat16), tmp_path / "h")
    assert load_head(tmp_path / "h").fc.weight.dtype == torch.bfloat16
    loaded = load_head(tmp_path / "h", dtype=torch.float32)
    assert loaded.fc.weight.dtype == torch.float32 and loaded.inv_freq.dtype == torch.float32


def test_sharded_and_bin_weights_load(tmp_path):
    state = tensors("midlayer.")
    names = sorted(state)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(specforge_config()))
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(sharded / file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, keys in halves.items() for k in keys}}))
    assert_holds(load_head(sharded, target()), state)
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text(json.dumps(specforge_config()))
    torch.save(state, binary / "pytorch_model.bin")
    assert_holds(load_head(binary, target()), state)


# -- refusals -------------------------------------------------------------------------------------------
@pytest.fixture
def specforge_head(tmp_path):
    return write(tmp_path / "h", specforge_config(), tensors("midlayer."))


@pytest.mark.parametrize("wrong, message", [
    (dict(hidden_size=64, intermediate_size=128), "hidden_size is 64"),
    (dict(vocab_size=256), "vocab_size is 256"),
    (dict(num_hidden_layers=4), r"out of range: a 4-layer target"),
])
def test_a_head_that_does_not_fit_is_refused(specforge_head, wrong, message):
    with pytest.raises(ValueError, match=message):
        load_head(specforge_head, target(**wrong))


def test_a_head_for_another_model_type_is_refused(tmp_path):
    folder = write(tmp_path / "h", speculators_config(), tensors("layers.0."))
    other = MistralConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          num_key_value_heads=KV, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="'llama' target; this target is 'mistral'"):
        load_head(folder, other)
    config = read_config(folder)
    check_fit(config, target())
    with pytest.raises(ValueError, match="mistral"):
        check_fit(config, other)


def test_missing_and_unexpected_keys_are_named(tmp_path):
    state = tensors("midlayer.")
    del state["midlayer.mlp.up_proj.weight"]
    state["fc_norm.0.weight"] = torch.ones(H)
    with pytest.raises(ValueError, match=r"missing midlayer\.mlp\.up_proj\.weight; unexpected fc_norm\.0\.weight"):
        load_head(write(tmp_path / "h", specforge_config(), state), target())


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    state = tensors("layers.0.")
    state["layers.0.self_attn.k_proj.weight"] = torch.zeros(HEADS * HD, 2 * H)
    with pytest.raises(ValueError, match=r"midlayer\.self_attn\.k_proj\.weight has shape \(32, 64\)"):
        load_head(write(tmp_path / "h", speculators_config(), state), target())


def test_bad_folders_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no head folder"):
        load_head(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_head(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3.*speculators_model_type"):
        load_head(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(specforge_config()))
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_head(tmp_path / "empty")
    with pytest.raises(ValueError, match="unknown head layout 'eagle'"):
        save_head(random_head(), tmp_path / "out", "eagle")


@pytest.mark.parametrize("config, message", [
    (speculators_config(norm_before_residual=True), "norm_before_residual=True"),
    ({k: v for k, v in speculators_config().items() if k != "norm_before_residual"}, "ambiguous"),
    (speculators_config(norm_output=True), "norm_output=True"),
    (specforge_config(fc_norm=True), "fc_norm=True"),
    (specforge_config(num_hidden_layers=2), "num_hidden_layers=2"),
    (specforge_config(target_hidden_size=64), "64-wide target"),
])
def test_variants_the_head_does_not_compute_are_refused(tmp_path, config, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        read_config(tmp_path)
