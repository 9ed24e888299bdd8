"""vlm_pack's own packed linear-attention layers, one layer at a time, against the STOCK transformers module.

For every recurrent layer vlm_pack computes itself (Gated DeltaNet in both parameter layouts, Qwen3.5-MoE's copy,
LFM2's short conv, NemotronH's Mamba-2 mixer), one packed row through the installed forward must equal each sample
run alone through the stock module (its class forward, no boundaries): outputs within 16x the stock module's own
fp32-vs-fp64 gap (tests/tolerance.py), gradients of every parameter and of the inputs within its relative L2 bound.
This runs on whichever transformers is installed; the same file passes on the floor (5.17), the pins and the
newest release (issue 43; see the closing report). Corruptions: the conv window or the recurrent state carried over
the whole row (boundaries ignored) must land far outside the noise.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from vlm_pack.attention import gated_deltanet as gd
from vlm_pack.attention import linear as la
from vlm_pack.attention import mamba2 as m2
from vlm_pack.attention.packed_layers import install_linear_attention_packing

from fla_fakes import install_fake_fla
from tolerance import NoiseFloor, assert_grads_close, fp64_copy, max_abs

pytestmark = pytest.mark.usefixtures("one_thread")

_DELTANET = {"hidden_size": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
             "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "hidden_act": "silu",
             "layer_types": ["linear_attention"], "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "vocab_size": 64}
# (module of the stock layer, its class, config class, config fields); Mamba-2: dt_bias low enough that the
# release's dt clamp (time_step_min on <= 5.24, time_step_limit on 5.25) decides some steps.
LAYERS = {
    "qwen3_5": ("qwen3_5", "Qwen3_5GatedDeltaNet", "Qwen3_5TextConfig", _DELTANET),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeTextConfig", _DELTANET),
    "qwen3_next": ("qwen3_next", "Qwen3NextGatedDeltaNet", "Qwen3NextConfig", _DELTANET),
    "lfm2": ("lfm2", "Lfm2ShortConv", "Lfm2Config",
             {"hidden_size": 48, "conv_L_cache": 3, "conv_bias": False, "layer_types": ["conv"],
              "num_hidden_layers": 1}),
    "lfm2_bias": ("lfm2", "Lfm2ShortConv", "Lfm2Config",
                  {"hidden_size": 48, "conv_L_cache": 4, "conv_bias": True, "layer_types": ["conv"],
                   "num_hidden_layers": 1}),
    "nemotron_h": ("nemotron_h", "NemotronHMamba2Mixer", "NemotronHConfig",
                   {"hidden_size": 48, "mamba_num_heads": 8, "mamba_head_dim": 6, "n_groups": 2,
                    "ssm_state_size": 8, "conv_kernel": 4, "layers_block_type": ["linear_attention"],
                    "num_hidden_layers": 1, "use_conv_bias": True}),
}
# Lengths cross the 64-token chunk (several chunks, several buckets) and include 1-token samples.
LENGTHS = [70, 1, 33, 64, 130, 5, 1]


def stock_layer(name: str) -> tuple[torch.nn.Module, object]:
    """The stock module of ``LAYERS[name]`` with random weights (decays and norms too), and its config."""
    module_name, class_name, config_name, fields = LAYERS[name]
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    config = getattr(importlib.import_module("transformers"), config_name)(**fields)
    torch.manual_seed(0)
    layer = getattr(modeling, class_name)(config, layer_idx=0)
    with torch.no_grad():
        for pname, param in layer.named_parameters():
            if pname == "dt_bias":
                param.uniform_(-9, 1)
            elif pname in ("A_log", "D") or pname.startswith("norm"):
                param.uniform_(0.2, 1.5)
            else:
                param.normal_(0, param.shape[-1] ** -0.5)
    return layer, config


def packed_copy(layer: torch.nn.Module, config: object, backend: str = "torch_segments") -> torch.nn.Module:
    """A copy of ``layer`` with vlm_pack's packed forward installed (inside a holder: install hooks the parent)."""
    holder = torch.nn.ModuleList([copy.deepcopy(layer)])
    assert len(install_linear_attention_packing(holder, {type(layer).__name__}, backend, config)) == 1
    return holder[0]


@pytest.fixture(scope="module", params=list(LAYERS))
def layers(request):
    pytest.importorskip(f"transformers.models.{LAYERS[request.param][0]}")
    layer, config = stock_layer(request.param)
    return request.param, layer, packed_copy(layer, config), fp64_copy(layer)


def samples(width: int, lengths=LENGTHS, seed=1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, width, generator=generator) for n in lengths]


def cu_seqlens(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed_error(stock, packed, stock64, lengths=LENGTHS) -> tuple[float, NoiseFloor]:
    """Largest |packed - stock alone| over the samples' outputs, and the stock layer's fp32 noise floor."""
    xs = samples(stock.out_proj.out_features, lengths)
    floor = NoiseFloor("layer output")
    with torch.no_grad():
        alone = [stock(x) for x in xs]
        for x, out in zip(xs, alone):
            floor.observe(out, stock64(x.double()))
        row = packed(torch.cat(xs, 1), cu_seq_lens_q=cu_seqlens(lengths)).split(lengths, 1)
    return max(max_abs(p, r) for p, r in zip(row, alone)), floor


def test_packed_layer_equals_each_sample_alone_through_the_stock_layer(layers):
    name, stock, packed, stock64 = layers
    error, floor = packed_error(stock, packed, stock64)
    print(f"{name}: max |packed - stock alone| = {error:.3g}, tolerance {floor.tolerance:.3g}")
    floor.check(error, name)


def test_packed_layer_gradients_equal_the_stock_layers(layers):
    """Gradients of every parameter and of each sample's inputs, the loss a fixed random projection of the output."""
    _, stock, packed, _ = layers
    xs = samples(stock.out_proj.out_features, seed=2)
    weights = [torch.randn_like(x, dtype=torch.float32) for x in xs]
    stock.zero_grad()
    inputs = [x.clone().requires_grad_() for x in xs]
    sum((stock(x) * w).sum() for x, w in zip(inputs, weights)).backward()
    want = {n: p.grad.clone() for n, p in stock.named_parameters()} | {"inputs": torch.cat([x.grad for x in inputs], 1)}
    packed.zero_grad()
    row = torch.cat(xs, 1).requires_grad_()
    (packed(row, cu_seq_lens_q=cu_seqlens(LENGTHS)) * torch.cat(weights, 1)).sum().backward()
    got = {n: p.grad.clone() for n, p in packed.named_parameters()} | {"inputs": row.grad}
    assert_grads_close(got, want)


def whole_row(lengths=LENGTHS) -> la.SegmentLayout:
    """The layout of ONE sample spanning the row: what a layer that ignores boundaries computes."""
    return la.SegmentLayout.from_cu_seqlens(torch.tensor([0, sum(lengths)]), sum(lengths))


def test_conv_window_not_restarted_is_caught(layers, monkeypatch):
    """Corruption: the causal conv over the whole row (a sample's first K-1 tokens read the previous sample's)."""
    _, stock, packed, stock64 = layers
    exact = la.segmented_causal_conv1d
    monkeypatch.setattr(la, "segmented_causal_conv1d",
                        lambda hidden, weight, bias, activation, layout: exact(hidden, weight, bias, activation,
                                                                               whole_row()))
    error, floor = packed_error(stock, packed, stock64)
    assert floor.is_far(error), (error, floor.tolerance)


@pytest.mark.parametrize("name", [n for n in LAYERS if not n.startswith("lfm2")])
def test_state_not_restarted_is_caught(name, monkeypatch):
    """Corruption: the recurrence (delta rule, selective scan) over the whole row: state carried across samples."""
    pytest.importorskip(f"transformers.models.{LAYERS[name][0]}")
    stock, config = stock_layer(name)
    packed, stock64 = packed_copy(stock, config), fp64_copy(stock)
    module, function = (m2, "segmented_selective_scan") if name == "nemotron_h" else (gd, "segmented_gated_delta_rule")
    exact = getattr(module, function)
    monkeypatch.setattr(module, function, lambda *args: exact(*args[:-1], whole_row()))
    error, floor = packed_error(stock, packed, stock64)
    assert floor.is_far(error), (error, floor.tolerance)


def test_unpacked_calls_run_the_stock_forward(layers):
    """No boundaries (an ordinary batch of two rows): the class's own forward, bit for bit."""
    _, stock, packed, _ = layers
    x = torch.randn(2, 9, stock.out_proj.out_features, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(packed(x), stock(x))


@pytest.mark.parametrize("name", list(LAYERS))
def test_fla_route_hands_the_kernels_the_boundaries(name, monkeypatch):
    """backend="fla" (faked on CPU, real signatures): the conv, and a DeltaNet's delta rule, get int32 cu_seqlens
    and fla's layouts; Mamba-2's scan stays on the torch path."""
    pytest.importorskip(f"transformers.models.{LAYERS[name][0]}")
    rule, conv = install_fake_fla(monkeypatch)
    stock, config = stock_layer(name)
    packed = packed_copy(stock, config, backend="fla")
    lengths = [7, 12, 5]
    with torch.no_grad():
        packed(torch.cat(samples(stock.out_proj.out_features, lengths), 1),
               cu_seq_lens_q=cu_seqlens(lengths).long())
    weight = (stock.conv1d if hasattr(stock, "conv1d") else stock.conv).weight
    (call,) = conv.calls
    assert call["cu_seqlens"].dtype == torch.int32 and call["cu_seqlens"].tolist() == [0, 7, 19, 24]
    assert call["args"][0].shape == (1, 24, weight.shape[0])
    assert call["weight"].shape == (weight.shape[0], weight.shape[-1])
    assert call["activation"] == (None if name.startswith("lfm2") else "silu")
    assert len(rule.calls) == (1 if name.startswith("qwen") else 0)
    for call in rule.calls:
        q, k, v = call["args"]
        assert q.shape == k.shape == (1, 24, config.linear_num_key_heads, config.linear_key_head_dim)
        assert v.shape == (1, 24, config.linear_num_value_heads, config.linear_value_head_dim)
        assert call["cu_seqlens"].tolist() == [0, 7, 19, 24] and call["use_qk_l2norm_in_kernel"] is True


@pytest.mark.parametrize(("name", "targets"), [("qwen3_5", ["in_proj_qkv", "in_proj_z", "out_proj"]),
                                               ("qwen3_next", ["in_proj_qkvz", "out_proj"]),
                                               ("lfm2", ["in_proj", "out_proj"])])
def test_layer_with_lora_adapters_installed_first(name, targets):
    """PEFT LoRA applied before enable_packing wraps the projections (``in_proj_qkv.base_layer.weight``): the layer
    is still recognised, and its packed output equals each sample alone through the adapted stock layer."""
    peft = pytest.importorskip("peft")
    pytest.importorskip(f"transformers.models.{LAYERS[name][0]}")
    stock, config = stock_layer(name)
    holder = torch.nn.ModuleList([stock])
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=targets), holder)
    with torch.no_grad():
        for pname, param in holder.named_parameters():
            if "lora_B" in pname:
                param.normal_(0, 0.5)
    adapted, adapted64 = copy.deepcopy(holder[0]), fp64_copy(holder[0])
    install_linear_attention_packing(holder, {type(stock).__name__}, "torch_segments", config)
    error, floor = packed_error(adapted, holder[0], adapted64)
    floor.check(error, name)
    assert floor.is_far(packed_error(stock_layer(name)[0], holder[0], adapted64)[0])  # the adapters count


def test_unknown_parameter_layout_is_refused_at_install():
    """A named class whose parameters are no layer vlm_pack knows fails when installed, naming it."""
    holder = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    with pytest.raises(NotImplementedError, match="Linear has parameters .* not a layer vlm_pack packs"):
        install_linear_attention_packing(holder, {"Linear"}, "torch_segments", config=object())


def test_deltanet_config_that_does_not_match_the_parameters_is_refused():
    pytest.importorskip("transformers.models.qwen3_5")
    layer, config = stock_layer("qwen3_5")
    config.linear_num_value_heads = 8
    with pytest.raises(NotImplementedError, match="do not match a Gated DeltaNet"):
        packed_copy(layer, config)


def test_nemotron_h_model_packs_per_sample_through_its_mixers():
    """A whole NemotronH model (Mamba-2 and MLP blocks, no attention) with the packed mixer installed: the row's
    logits equal each sample alone through the stock model (the boundaries reach the mixers through the model's own
    kwargs); position ids without boundaries are refused at the first mixer block."""
    transformers = pytest.importorskip("transformers")
    fields = dict(LAYERS["nemotron_h"][3], vocab_size=300, intermediate_size=64, num_hidden_layers=3,
                  layers_block_type=["linear_attention", "mlp", "linear_attention"])
    torch.manual_seed(0)
    reference = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**fields))
    reference64, model = fp64_copy(reference), copy.deepcopy(reference)
    assert len(install_linear_attention_packing(model, {"NemotronHMamba2Mixer"})) == 2
    lengths = [70, 5, 33, 130]
    generator = torch.Generator().manual_seed(4)
    ids = [torch.randint(0, 300, (1, n), generator=generator) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    floor = NoiseFloor("logits")
    with torch.no_grad():
        alone = [reference(input_ids=x, use_cache=False).logits[0] for x in ids]
        for x, logits in zip(ids, alone):
            floor.observe(logits, reference64(input_ids=x, use_cache=False).logits[0])
        row = model(input_ids=torch.cat(ids, 1), position_ids=positions, use_cache=False,
                    **{f"cu_seq_lens_{s}": cu_seqlens(lengths) for s in "qk"}).logits[0].split(lengths)
        floor.check(max(max_abs(p, r) for p, r in zip(row, alone)))
        with pytest.raises(ValueError, match="without cu_seq_lens_q"):
            model(input_ids=torch.cat(ids, 1), position_ids=positions, use_cache=False)
