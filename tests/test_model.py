"""The GPT around the attention: its layers, its initialisation, its FLOP count, and sampling."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from model import GPT, VARIANTS
from model.sampling import next_token, nucleus
from tiny_models import tiny_config


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("attention", "flash2", "valid choices: " + ", ".join(VARIANTS)),
        ("attention", "sdpa_math", "'sdpa_math' (did you mean 'sdpa-math'"),
        ("n_head", 5, "n_embd=32 is not divisible by n_head=5"),
        ("n_layer", 0, "n_layer=0"),
        ("vocab_size", -3, "vocab_size=-3"),
        ("block_size", 2.5, "block_size=2.5"),
        ("dropout", 1.0, "dropout=1.0"),
        ("bias", "yes", "bias='yes'"),
    ],
)
def test_bad_config_names_field_and_value(field: str, value: object, expect: str) -> None:
    with pytest.raises(ValueError, match=expect.replace("(", r"\(")) as err:
        tiny_config(**{field: value})
    assert field in str(err.value)


def test_flops_per_token_agrees_with_the_flop_counter() -> None:
    """The formula train.py logs TFLOP/s and MFU by, against the count the profiler's MFU
    uses: the same, so the two tools' MFU differ only by the peak each divides by."""
    from torch.utils.flop_counter import FlopCounterMode

    model = GPT(tiny_config(n_embd=64, n_head=2, vocab_size=128))
    idx = torch.randint(0, 128, (2, 64))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx)[1].backward()
    assert model.flops_per_token() * idx.numel() == counter.get_total_flops()


def test_sequence_longer_than_block_size() -> None:
    model = GPT(tiny_config(block_size=8))
    with pytest.raises(ValueError, match="exceeds block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_only_boolean_mask_variants_hold_a_causal_mask() -> None:
    """naive and inplace (variants with no make_mask) read a (block_size, block_size) mask;
    SDPA passes is_causal and flex builds its own, so their models hold none: at block_size
    32768 it would be 1 GiB."""
    assert [n for n, v in VARIANTS.items() if v.make_mask is None][:2] == ["naive", "inplace"]
    for name, variant in VARIANTS.items():
        model = GPT(tiny_config(name, block_size=128))
        held = model.causal_mask is not None
        assert held == (variant.make_mask is None), name
        assert "causal_mask" not in model.state_dict()
        if variant.backend is not None or name == "sdpa":
            assert model.attention_mask(16) is None, name
    assert GPT(tiny_config("naive")).attention_mask(3).tolist() == [
        [False, True, True],
        [False, False, True],
        [False, False, False],
    ]


def test_weight_tying_and_init() -> None:
    torch.manual_seed(0)
    model = GPT(tiny_config(n_layer=8, n_embd=64, block_size=256))
    assert model.lm_head.weight is model.wte.weight
    for block in model.blocks:  # both residual branches' output projections: 1/sqrt(2 * 8)
        for proj in (block.attn.c_proj.weight, block.mlp.c_proj.weight):
            assert proj.std().item() == pytest.approx(0.02 / 4, rel=0.1)
        assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.wpe.weight.std().item() == pytest.approx(0.02, rel=0.1)
    biases = [m.bias for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert biases and all(torch.equal(b, torch.zeros_like(b)) for b in biases if b is not None)


def test_bias_false_leaves_no_bias_anywhere() -> None:
    """model.bias=false drops every Linear's and LayerNorm's bias (nanoGPT's `bias`)."""
    biases = lambda model: [n for n, _ in model.named_parameters() if n.endswith(".bias")]
    assert biases(GPT(tiny_config(bias=False))) == []
    with_bias = biases(GPT(tiny_config(bias=True)))
    for part in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "ln_1", "ln_2"):
        assert f"blocks.0.{part}.bias" in with_bias
    assert "ln_f.bias" in with_bias


def test_pre_layernorm_residual_stream() -> None:
    """With every residual branch's output projection zeroed, the blocks pass the stream
    through untouched (pre-LN: the norms sit inside the branches), so the features are
    ln_f(token + position embeddings). A post-LN block, or a missing ln_f, changes them."""
    torch.manual_seed(0)
    model = GPT(tiny_config())
    with torch.no_grad():
        for block in model.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.zero_()
                proj.bias.zero_()
            block.ln_1.weight.mul_(3)  # norms away from identity, so a misplaced one shows
            block.ln_2.weight.mul_(3)
        model.ln_f.weight.mul_(0.5)
    idx = torch.randint(0, 97, (2, 16))
    expected = model.ln_f(model.wte(idx) + model.wpe(torch.arange(16)))
    torch.testing.assert_close(model.features(idx), expected)


def test_every_parameter_gets_a_gradient() -> None:
    torch.manual_seed(0)
    model = GPT(tiny_config())
    idx = torch.randint(0, 97, (2, 16))
    model(idx, idx)[1].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_position_embeddings_distinguish_positions() -> None:
    """The same token repeated: attention over identical tokens averages identical values,
    so only the position embeddings can make one position's logits differ from another's."""
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    logits, _ = model(torch.full((1, 16), 5))
    for t in range(1, 16):
        assert not torch.allclose(logits[0, 0], logits[0, t]), t


def test_loss_ignores_targets_of_minus_one() -> None:
    torch.manual_seed(0)
    model = GPT(tiny_config())
    idx = torch.randint(0, 97, (2, 16))
    targets = torch.randint(0, 97, (2, 16))
    logits, _ = model(idx)
    ignored = torch.rand(2, 16) < 0.4
    _, loss = model(idx, targets.masked_fill(ignored, -1))
    expected = F.cross_entropy(logits[~ignored], targets[~ignored])
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("module", ["drop", "attn.resid_dropout", "mlp.dropout"])
def test_each_dropout_module_acts_in_training(module: str) -> None:
    """Set one nn.Dropout at a time to p=0.5 (attention dropout off): the output must change
    between two training forwards and not in eval, so each one is on the model's path."""
    torch.manual_seed(0)
    model = GPT(tiny_config())
    chosen = [m for name, m in model.named_modules() if name.endswith(module)]
    assert chosen
    for m in chosen:
        m.p = 0.5
    idx = torch.randint(0, 97, (2, 16))
    assert not torch.equal(model(idx)[0], model(idx)[0])
    model.eval()
    assert torch.equal(model(idx)[0], model(idx)[0])


def test_generate() -> None:
    torch.manual_seed(0)
    model = GPT(tiny_config(block_size=16)).eval()
    prompt = torch.randint(0, 97, (2, 5))
    out = model.generate(prompt, 20, temperature=0)  # runs past block_size: context is cropped
    assert out.shape == (2, 25) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, model.generate(prompt, 20, temperature=1.0, top_k=1))
    # Greedy picks the argmax of the full forward's last-position logits, cropped or not.
    for t in (5, 16, 24):
        logits, _ = model(out[:, max(0, t - 16) : t])
        assert torch.equal(out[:, t], logits[:, -1].argmax(-1))
    sampled = model.generate(prompt, 20, temperature=1.0, top_k=5)
    assert sampled.shape == (2, 25) and int(sampled.max()) < 97


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.5, [0.5, 0, 0, 0]), (0.7, [0.5, 0.3, 0, 0]), (0.81, [0.5, 0.3, 0.15, 0]), (1.0, None)],
)
def test_nucleus_keeps_the_fewest_likeliest_tokens_reaching_top_p(
    top_p: float, kept: list[float] | None
) -> None:
    order = [2, 0, 3, 1]  # the vocabulary order is not the order of likelihood
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    unsorted = torch.empty(4).scatter_(0, torch.tensor(order), probs)[None]
    expected = (
        unsorted
        if kept is None
        else torch.empty(4).scatter_(0, torch.tensor(order), torch.tensor(kept))[None]
    )
    assert torch.equal(nucleus(unsorted, top_p, torch.tensor([order])), expected)


def test_generate_top_p() -> None:
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    prompt = torch.randint(0, 97, (2, 5))

    def sample(**kwargs: Any) -> Tensor:
        return model.generate(prompt, 20, generator=torch.Generator().manual_seed(1), **kwargs)

    assert torch.equal(sample(temperature=1.0, top_p=1e-6), sample(temperature=0))
    assert torch.equal(sample(temperature=1.0, top_p=1.0), sample(temperature=1.0))
    assert not torch.equal(sample(temperature=1.0, top_p=0.5), sample(temperature=1.0))
    for bad in (0.0, 1.5, math.nan):
        with pytest.raises(ValueError, match=f"top_p={bad}"):
            model.generate(prompt, 1, top_p=bad)
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match=f"temperature={bad}"):
            model.generate(prompt, 1, temperature=bad)


@pytest.mark.parametrize("temperature", [math.inf, 1e38])
def test_top_k_and_top_p_keep_the_likeliest_at_any_temperature(temperature: float) -> None:
    """A huge temperature flattens the scaled scores to ties; the tokens kept are still the
    model's likeliest, so top_k=1 (or a top_p below one token's share) stays greedy."""
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    prompt = torch.randint(0, 97, (2, 5))

    def sample(**kwargs: Any) -> Tensor:
        return model.generate(prompt, 12, generator=torch.Generator().manual_seed(1), **kwargs)

    greedy = sample(temperature=0)
    assert torch.equal(sample(temperature=temperature, top_k=1), greedy)
    assert torch.equal(sample(temperature=temperature, top_p=0.005), greedy)  # 1/97 > 0.005
    assert not torch.equal(sample(temperature=temperature, top_k=2), greedy)


@pytest.mark.parametrize(("top_k", "kept"), [(1, {1}), (2, {1, 3}), (3, {1, 3, 4})])
def test_top_k_keeps_exactly_k_when_scores_tie(top_k: int, kept: set[int]) -> None:
    """bf16 scores tie often. Ties at the k-th score go to the lower id, as argmax breaks them:
    exactly k ids can be drawn, and top_k=1 is greedy."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, 2.0]])  # ids 1, 3, 4, 5 tie for first
    drawn = {
        next_token(logits, 1.0, top_k, None, torch.Generator().manual_seed(seed)).item()
        for seed in range(200)
    }
    assert drawn == kept
    assert next_token(logits, 0.0, None, None, None).item() == 1


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_draws_from_the_softmax_of_the_scores_over_it(temperature: float) -> None:
    """Each id is drawn as often as softmax(logits / temperature) says: lower sharpens,
    higher flattens (4000 draws at once: the share is within 0.03 at over 4 sigma)."""
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(4000, 3)
    drawn = next_token(logits, temperature, None, None, torch.Generator().manual_seed(0))
    share = torch.bincount(drawn.flatten(), minlength=3) / len(drawn)
    expected = F.softmax(logits[0] / temperature, dim=-1)
    torch.testing.assert_close(share, expected, atol=0.03, rtol=0)


def test_generate_stops_once_every_row_sampled_the_stop_id() -> None:
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    prompt = torch.randint(0, 97, (3, 4))
    gen = torch.Generator().manual_seed(2)
    full = model.generate(prompt, 200, temperature=1.0, generator=gen)
    new = full[:, 4:]
    stop = int(new[0, 10])  # row 0 samples it at its 11th token; the others, whenever they do
    firsts = [row.tolist().index(stop) if stop in row else None for row in new]
    assert all(f is not None for f in firsts), "each row samples it within 200 tokens"
    gen.manual_seed(2)
    cut = model.generate(prompt, 200, temperature=1.0, generator=gen, stop_id=stop)
    assert cut.shape[1] == 4 + max(firsts) + 1  # until the last row's first stop
    assert torch.equal(cut, full[:, : cut.shape[1]])  # the same draws up to there


def test_generate_tiny_temperature_is_greedy_not_nan() -> None:
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    prompt = torch.randint(0, 97, (2, 5))
    greedy = model.generate(prompt, 10, temperature=0)
    # 1e-45 overflows unshifted logits to inf, and softmax to NaN; 1e-50 is 0 in fp32.
    for tiny in (1e-45, 1e-50, 1e-320):
        assert torch.equal(model.generate(prompt, 10, temperature=tiny), greedy), tiny


def test_generate_draws_from_the_scores_its_logits_hook_returns() -> None:
    """The hook gets each step's index and the last position's fp32 scores, before temperature,
    top_k and top_p; what it returns is drawn from: here the ids from 10 up cut at every step
    (an infinite temperature then draws uniformly among the rest), and one id forced at step 1."""
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()  # vocab_size 97
    prompt = torch.randint(0, 97, (2, 5))
    seen: list[tuple[int, Tensor]] = []

    def hook(step: int, logits: Tensor) -> Tensor:
        seen.append((step, logits))
        logits = logits[:, :10]
        return logits.masked_fill(torch.arange(10) != 7, -math.inf) if step == 1 else logits

    out = model.generate(prompt, 50, temperature=math.inf, top_k=50, logits_hook=hook)
    assert [step for step, _ in seen] == list(range(50))
    torch.testing.assert_close(seen[0][1], model(prompt)[0][:, -1])  # raw: not scaled, not cut
    assert seen[0][1].dtype == torch.float32
    assert out[:, 6].tolist() == [7, 7]
    assert set(out[:, 5:].flatten().tolist()) == set(range(10))


def test_generate_refuses_top_k_zero() -> None:
    from model.sampling import check_sampling

    with pytest.raises(ValueError, match="top_k=0"):
        check_sampling(1.0, 0, None)
