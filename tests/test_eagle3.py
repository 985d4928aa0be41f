"""EAGLE-3 drafter, TTT attention and loss (METHOD §4), checked against loop references on tiny random configs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dspark.drafters.eagle3 import Eagle3Drafter, Eagle3Output, create_ttt_mask
from dspark.drafters.layers import DraftLayerSpec
from dspark.losses.eagle3 import (
    compute_eagle3_acceptance_proxy,
    compute_eagle3_loss,
    create_eagle3_loss_mask,
)

VOCAB, HIDDEN, M = 97, 32, 2


def make_spec(qk_norm: bool = True) -> DraftLayerSpec:
    return DraftLayerSpec(
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        qk_norm=qk_norm,
        vocab_size=VOCAB,
    )


def make_drafter(*, block_size: int = 3, qk_norm: bool = True, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    embed = nn.Embedding(VOCAB, HIDDEN)
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
    nn.init.normal_(lm_head.weight, std=0.5)  # a peaked head so logits differ visibly between inputs
    drafter = Eagle3Drafter(
        spec=make_spec(qk_norm), num_feature_layers=M, block_size=block_size, embed_tokens=embed, lm_head=lm_head
    )
    # Non-trivial norm weights so a wrongly placed norm changes the numbers.
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return drafter


def make_batch(batch: int, seq_len: int, *, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, seq_len, M * HIDDEN, generator=gen)
    input_ids = torch.randint(0, VOCAB, (batch, seq_len), generator=gen)
    return features, input_ids


def run(drafter: Eagle3Drafter, features: torch.Tensor, input_ids: torch.Tensor) -> Eagle3Output:
    mask = torch.ones(input_ids.shape, dtype=torch.bool)
    return drafter(features=features, input_ids=input_ids, attention_mask=mask)


def rotate(x: torch.Tensor, position: int, head_dim: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of one vector [.., hd] at an integer position, written out independently."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angle = torch.cat([position * inv_freq] * 2)
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * angle.cos() + rotated * angle.sin()


def project(drafter: Eagle3Drafter, g: torch.Tensor, tokens: torch.Tensor, offset: int):
    """Per-position q [B,T,H,hd], k, v [B,T,KV,hd] of one step, RoPE at position i + offset."""
    layer, attn, spec = drafter.layer, drafter.layer.self_attn, drafter.spec
    batch, seq_len, _ = g.shape
    u = torch.cat([layer.input_norm(tokens), layer.hidden_norm(g)], dim=-1)
    q = attn.q_norm(attn.q_proj(u).view(batch, seq_len, spec.num_attention_heads, spec.head_dim))
    k = attn.k_norm(attn.k_proj(u).view(batch, seq_len, spec.num_key_value_heads, spec.head_dim))
    v = attn.v_proj(u).view(batch, seq_len, spec.num_key_value_heads, spec.head_dim)
    for i in range(seq_len):
        q[:, i] = rotate(q[:, i], i + offset, spec.head_dim, spec.rope_theta)
        k[:, i] = rotate(k[:, i], i + offset, spec.head_dim, spec.rope_theta)
    return q, k, v


def finish_layer(drafter: Eagle3Drafter, g: torch.Tensor, attn_heads: torch.Tensor) -> torch.Tensor:
    """Residual + o_proj + post-norm MLP: attn_heads [B, T, H, hd] → h [B, T, d]."""
    layer = drafter.layer
    hidden = g + layer.self_attn.o_proj(attn_heads.flatten(-2))
    return hidden + layer.mlp(layer.post_attention_norm(hidden))


@torch.no_grad()
def reference_ttt(drafter: Eagle3Drafter, features: torch.Tensor, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """TTT by explicit loops: query (b, i, head) of step k attends to the listed keys
    {step 0, j ≤ i} ∪ {step s, position i : s = 1..k}; catches any mask, shift or RoPE-offset slip."""
    spec = drafter.spec
    batch, seq_len = input_ids.shape
    groups = spec.num_attention_heads // spec.num_key_value_heads
    g = drafter.fc(features)
    embeds = drafter.embed_tokens(input_ids)
    keys, values, logits = [], [], []
    for step in range(drafter.block_size):
        tokens = torch.zeros_like(embeds)
        tokens[:, : max(seq_len - step - 1, 0)] = embeds[:, step + 1 :]
        q, k, v = project(drafter, g, tokens, step)
        keys.append(k)
        values.append(v)
        heads = torch.zeros_like(q)
        for b in range(batch):
            for i in range(seq_len):
                for h in range(spec.num_attention_heads):
                    kv = h // groups
                    ks = [keys[0][b, j, kv] for j in range(i + 1)] + [keys[s][b, i, kv] for s in range(1, step + 1)]
                    vs = [values[0][b, j, kv] for j in range(i + 1)] + [values[s][b, i, kv] for s in range(1, step + 1)]
                    scores = torch.stack(ks) @ q[b, i, h] / math.sqrt(spec.head_dim)
                    heads[b, i, h] = torch.softmax(scores, dim=0) @ torch.stack(vs)
        g = finish_layer(drafter, g, heads)
        logits.append(drafter.lm_head(drafter.norm(g)))
    return logits


def test_create_ttt_mask_matches_hand_written_case():
    """T = 4: step 0 is lower-triangular; each later step adds the identity block (own position only)."""
    step0 = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    step1 = [[1, 0, 0, 0, 1, 0, 0, 0], [1, 1, 0, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0, 1, 0], [1, 1, 1, 1, 0, 0, 0, 1]]
    step2 = [
        [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1],
    ]
    for step, expected in enumerate([step0, step1, step2]):
        mask = create_ttt_mask(4, step)
        assert mask.dtype == torch.bool
        assert mask.tolist() == torch.tensor(expected, dtype=torch.bool).tolist()


@pytest.mark.parametrize("qk_norm", [True, False])
def test_ttt_forward_matches_loop_reference(qk_norm):
    drafter = make_drafter(qk_norm=qk_norm)
    features, input_ids = make_batch(2, 6)
    with torch.no_grad():
        out = run(drafter, features, input_ids)
    expected = reference_ttt(drafter, features, input_ids)
    assert len(out.logits) == len(out.hidden) == 3
    for step in range(3):
        assert out.logits[step].shape == (2, 6, VOCAB)
        torch.testing.assert_close(out.logits[step], expected[step], rtol=1e-4, atol=1e-4)


def test_step0_equals_plain_causal_layer():
    """Step 0 is an ordinary causal decoder layer over (f_i, x_{i+1}) with RoPE positions 0..T-1."""
    drafter = make_drafter()
    features, input_ids = make_batch(2, 7)
    spec = drafter.spec
    with torch.no_grad():
        out = run(drafter, features, input_ids)
        g = drafter.fc(features)
        tokens = torch.cat([drafter.embed_tokens(input_ids[:, 1:]), torch.zeros(2, 1, HIDDEN)], dim=1)
        q, k, v = (x.transpose(1, 2) for x in project(drafter, g, tokens, 0))
        groups = spec.num_attention_heads // spec.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(spec.head_dim)
        scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
        heads = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)
        expected = drafter.lm_head(drafter.norm(finish_layer(drafter, g, heads)))
    torch.testing.assert_close(out.logits[0], expected, rtol=1e-4, atol=1e-4)


def test_outputs_are_causal_in_features_and_tokens():
    """Step k at position i depends on f_{≤i} and x_{≤i+1+k} only, and does depend on f_i and x_{i+1+k}."""
    drafter = make_drafter()
    features, input_ids = make_batch(1, 8)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        base = run(drafter, features, input_ids).logits
        for i in range(8):
            noisy_features = features.clone()
            noisy_features[:, i + 1 :] = torch.randn(noisy_features[:, i + 1 :].shape, generator=gen)
            changed_feature = features.clone()
            changed_feature[:, i] += 1.0
            after_features = run(drafter, noisy_features, input_ids).logits
            after_feature_i = run(drafter, changed_feature, input_ids).logits
            for step in range(3):
                torch.testing.assert_close(after_features[step][:, i], base[step][:, i])
                assert not torch.allclose(after_feature_i[step][:, i], base[step][:, i], atol=1e-4)
                cut = i + 2 + step  # first token position the output may not depend on
                noisy_ids = input_ids.clone()
                noisy_ids[:, cut:] = (noisy_ids[:, cut:] + 1 + torch.randint(0, VOCAB - 1, (1,), generator=gen)) % VOCAB
                torch.testing.assert_close(run(drafter, features, noisy_ids).logits[step][:, i], base[step][:, i])
                if cut - 1 < 8:
                    last_ids = input_ids.clone()
                    last_ids[:, cut - 1] = (last_ids[:, cut - 1] + 1) % VOCAB
                    changed = run(drafter, features, last_ids).logits[step][:, i]
                    assert not torch.allclose(changed, base[step][:, i], atol=1e-4)


def test_right_padding_does_not_change_real_positions():
    """A right-padded row gives the same logits as the unpadded row wherever the step's inputs are real."""
    drafter = make_drafter()
    features, input_ids = make_batch(1, 8)
    real = 5
    attention_mask = torch.zeros(1, 8, dtype=torch.bool)
    attention_mask[:, :real] = True
    with torch.no_grad():
        padded = drafter(features=features, input_ids=input_ids, attention_mask=attention_mask).logits
        alone = run(drafter, features[:, :real], input_ids[:, :real]).logits
    for step in range(3):
        n = real - step - 1
        torch.testing.assert_close(padded[step][:, :n], alone[step][:, :n])


def brute_force_loss(output, target_logits, loss_mask, attention_mask, step_weight):
    """Scalar loops over (b, k, i) straight from METHOD §4."""
    batch, seq_len, _ = target_logits.shape
    total, per_step, accuracy = 0.0, [], []
    for k, logits in enumerate(output.logits):
        ce_sum, hits, count = 0.0, 0, 0
        for b in range(batch):
            for i in range(seq_len):
                j = i + k + 1
                if j >= seq_len or not loss_mask[b, i + k] or not attention_mask[b, j]:
                    continue
                p_t = torch.softmax(target_logits[b, j].double(), dim=0)
                log_p_d = torch.log_softmax(logits[b, i].double(), dim=0)
                ce_sum += float(-(p_t * log_p_d).sum())
                hits += int(logits[b, i].argmax() == p_t.argmax())
                count += 1
        per_step.append(ce_sum / (batch * seq_len))
        accuracy.append(hits / max(count, 1))
        total += step_weight**k * per_step[-1]
    return total, per_step, accuracy


def random_loss_inputs(seed: int = 3, batch: int = 3, seq_len: int = 7, steps: int = 4):
    gen = torch.Generator().manual_seed(seed)
    logits = [torch.randn(batch, seq_len, VOCAB, generator=gen) * 2 for _ in range(steps)]
    target_logits = torch.randn(batch, seq_len, VOCAB, generator=gen) * 2
    lengths = torch.tensor([seq_len, seq_len - 2, 3])
    attention_mask = torch.arange(seq_len) < lengths[:, None]
    loss_mask = attention_mask & (torch.rand(batch, seq_len, generator=gen) < 0.8)
    output = Eagle3Output(logits=logits, hidden=[torch.zeros(batch, seq_len, HIDDEN)] * steps)
    return output, target_logits, loss_mask, attention_mask


def test_loss_matches_brute_force():
    output, target_logits, loss_mask, attention_mask = random_loss_inputs()
    loss = compute_eagle3_loss(
        output, target_logits=target_logits, loss_mask=loss_mask, attention_mask=attention_mask, step_weight=0.8
    )
    total, per_step, accuracy = brute_force_loss(output, target_logits, loss_mask, attention_mask, 0.8)
    assert loss.total.item() == pytest.approx(total, rel=1e-5)
    assert loss.per_step.tolist() == pytest.approx(per_step, rel=1e-5)
    assert loss.accuracy.tolist() == pytest.approx(accuracy)
    # The same loss from probabilities instead of logits.
    from_probs = compute_eagle3_loss(
        output, target_probs=torch.softmax(target_logits, -1), loss_mask=loss_mask, attention_mask=attention_mask
    )
    assert from_probs.total.item() == pytest.approx(total, rel=1e-5)


def test_loss_mask_definition_on_a_small_case():
    """T = 4, one row, loss on positions 1..3: step k at i needs loss_mask[i+k] and i+k+1 < T."""
    loss_mask = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    attention_mask = torch.ones(1, 4, dtype=torch.bool)
    mask = create_eagle3_loss_mask(loss_mask, attention_mask, num_steps=3)
    assert mask[0].T.int().tolist() == [
        [0, 1, 1, 0],  # step 0: i+1 < 4 and loss_mask[i]
        [1, 1, 0, 0],  # step 1: i+2 < 4 and loss_mask[i+1]
        [1, 0, 0, 0],
    ]  # step 2: i+3 < 4 and loss_mask[i+2]


def test_acceptance_proxy_matches_total_variation():
    output, target_logits, loss_mask, attention_mask = random_loss_inputs()
    proxy = compute_eagle3_acceptance_proxy(
        output, target_logits=target_logits, loss_mask=loss_mask, attention_mask=attention_mask
    )
    supervised = create_eagle3_loss_mask(loss_mask, attention_mask, num_steps=4)
    batch, seq_len, _ = target_logits.shape
    for b in range(batch):
        for i in range(seq_len):
            prefix = True
            for k in range(4):
                prefix = prefix and bool(supervised[b, i, k])
                assert bool(proxy.valid[b, i, k]) == prefix
                if not prefix:
                    assert proxy.c_star[b, i, k] == 0
                    continue
                p_d = torch.softmax(output.logits[k][b, i], 0)
                p_t = torch.softmax(target_logits[b, i + k + 1], 0)
                expected = 1 - 0.5 * (p_d - p_t).abs().sum()
                assert proxy.c_star[b, i, k].item() == pytest.approx(expected.item(), abs=1e-5)


def test_frozen_target_modules_stay_out_and_get_no_grad():
    drafter = make_drafter()
    names = [name for name, _ in drafter.named_parameters()] + list(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    frozen_ids = {id(drafter.embed_tokens.weight), id(drafter.lm_head.weight)}
    assert not frozen_ids & {id(p) for p in drafter.parameters()}
    features, input_ids = make_batch(2, 6)
    out = run(drafter, features, input_ids)
    mask = torch.ones(2, 6, dtype=torch.bool)
    loss = compute_eagle3_loss(out, target_logits=torch.randn(2, 6, VOCAB), loss_mask=mask, attention_mask=mask)
    loss.total.backward()
    assert drafter.embed_tokens.weight.grad is None and drafter.lm_head.weight.grad is None
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())


def test_adamw_steps_reduce_the_loss():
    drafter = make_drafter()
    features, input_ids = make_batch(2, 10, seed=5)
    target_logits = torch.randn(2, 10, VOCAB, generator=torch.Generator().manual_seed(6)) * 3
    mask = torch.ones(2, 10, dtype=torch.bool)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(15):
        loss = compute_eagle3_loss(
            run(drafter, features, input_ids), target_logits=target_logits, loss_mask=mask, attention_mask=mask
        ).total
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


def forced_sampler(tokens: list[int]):
    """sample_fn that returns the given tokens in order, with the T = 1 softmax as the draft distribution."""
    queue = list(tokens)

    def sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([queue.pop(0)]), torch.softmax(logits, dim=-1)

    return sample


def test_draft_chain_matches_ttt_at_the_last_context_position():
    """Teacher-forced drafts reproduce TTT step k at position S-1 (step 0 = the first draft, then every step)."""
    drafter = make_drafter(block_size=3)
    context_len, steps = 5, 3
    features, input_ids = make_batch(1, context_len + steps, seed=9)
    with torch.no_grad():
        ttt = run(drafter, features, input_ids).logits
    drafted = input_ids[0, context_len + 1 :].tolist()  # x_{S+1}, x_{S+2}, ... are what the chain predicts
    draft = drafter.draft_chain(
        context_features=features[:, :context_len],
        context_ids=input_ids[:, : context_len + 1],
        num_tokens=steps,
        sample_fn=forced_sampler(drafted + [0]),
    )
    assert draft.tokens.tolist() == [drafted + [0]]  # the last draft is sampled, never fed back
    assert draft.probs.shape == (1, steps, VOCAB)
    for step in range(steps):
        expected = torch.softmax(ttt[step][0, context_len - 1], dim=-1)
        torch.testing.assert_close(draft.probs[0, step], expected, rtol=1e-4, atol=1e-6)


def test_draft_chain_stops_at_a_stop_id():
    drafter = make_drafter(block_size=4)
    features, input_ids = make_batch(1, 6, seed=11)

    def greedy(logits):
        return logits.argmax(-1), torch.softmax(logits, -1)

    kwargs = dict(context_features=features, context_ids=torch.cat([input_ids, input_ids[:, :1]], 1), sample_fn=greedy)
    full = drafter.draft_chain(num_tokens=4, **kwargs)
    assert full.tokens.shape == (1, 4)
    stopped = drafter.draft_chain(num_tokens=4, stop_ids={int(full.tokens[0, 1])}, **kwargs)
    first_stop = full.tokens[0].tolist().index(int(full.tokens[0, 1]))
    assert stopped.tokens[0].tolist() == full.tokens[0, : first_stop + 1].tolist()
    torch.testing.assert_close(stopped.probs.sum(-1), torch.ones(1, first_stop + 1))


def test_bad_shapes_raise_value_errors():
    drafter = make_drafter()
    features, input_ids = make_batch(1, 5)
    with pytest.raises(ValueError, match="num_feature_layers"):
        run(drafter, features[..., :HIDDEN], input_ids)
    with pytest.raises(ValueError, match="context_ids"):
        drafter.draft_chain(
            context_features=features, context_ids=input_ids, num_tokens=2, sample_fn=forced_sampler([1, 2])
        )
    with pytest.raises(ValueError, match="block_size"):
        Eagle3Drafter(
            spec=make_spec(),
            num_feature_layers=M,
            block_size=0,
            embed_tokens=nn.Embedding(VOCAB, HIDDEN),
            lm_head=nn.Linear(HIDDEN, VOCAB, bias=False),
        )
    output = run(drafter, features, input_ids)
    mask = torch.ones(1, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="exactly one"):
        compute_eagle3_loss(output, loss_mask=mask, attention_mask=mask)


def test_sampled_positions_equal_the_full_loss_when_every_position_is_sampled():
    """logit_positions = all positions, all valid → same logits, loss, accuracy and proxy as the full TTT."""
    from dspark.losses.eagle3 import (
        compute_eagle3_sampled_acceptance,
        compute_eagle3_sampled_loss,
        sampled_step_targets,
    )

    drafter = make_drafter(block_size=3)
    features, input_ids = make_batch(2, 8, seed=4)
    attention_mask = torch.ones(2, 8, dtype=torch.bool)
    attention_mask[1, 6:] = False
    loss_mask = attention_mask.clone()
    loss_mask[:, :2] = False
    target_logits = torch.randn(2, 8, VOCAB, generator=torch.Generator().manual_seed(9)) * 2
    full = drafter(features=features, input_ids=input_ids, attention_mask=attention_mask)
    positions = torch.arange(8).expand(2, 8)
    sampled = drafter(features=features, input_ids=input_ids, attention_mask=attention_mask, logit_positions=positions)
    for a, b in zip(full.logits, sampled.logits):
        torch.testing.assert_close(a, b)
    index, supervised = sampled_step_targets(
        positions, torch.ones(2, 8, dtype=torch.bool), loss_mask=loss_mask, attention_mask=attention_mask, num_steps=3
    )
    gathered = target_logits.gather(1, index.flatten(1).unsqueeze(-1).expand(-1, -1, VOCAB)).view(2, 8, 3, VOCAB)
    want = compute_eagle3_loss(full, target_logits=target_logits, loss_mask=loss_mask, attention_mask=attention_mask)
    got = compute_eagle3_sampled_loss(sampled.logits, target_logits=gathered, supervised=supervised)
    torch.testing.assert_close(got.total, want.total)
    torch.testing.assert_close(got.accuracy, want.accuracy)
    assert got.num_supervised.tolist() == want.num_supervised.tolist()
    proxy_full = compute_eagle3_acceptance_proxy(
        full, target_logits=target_logits, loss_mask=loss_mask, attention_mask=attention_mask
    )
    proxy = compute_eagle3_sampled_acceptance(sampled.logits, target_logits=gathered, supervised=supervised)
    assert torch.equal(proxy.valid, proxy_full.valid)
    torch.testing.assert_close(proxy.c_star, proxy_full.c_star)


def test_sampled_positions_pick_the_right_rows_and_mask_invalid_ones():
    drafter = make_drafter(block_size=2)
    features, input_ids = make_batch(1, 9, seed=2)
    mask = torch.ones(1, 9, dtype=torch.bool)
    full = drafter(features=features, input_ids=input_ids, attention_mask=mask)
    positions = torch.tensor([[5, 1, 7]])
    sampled = drafter(features=features, input_ids=input_ids, attention_mask=mask, logit_positions=positions)
    for a, b in zip(full.logits, sampled.logits):
        torch.testing.assert_close(b[0], a[0, [5, 1, 7]])
    from dspark.losses.eagle3 import sampled_step_targets

    index, supervised = sampled_step_targets(
        positions, torch.tensor([[True, True, False]]), loss_mask=mask, attention_mask=mask, num_steps=2
    )
    assert index[0].tolist() == [[6, 7], [2, 3], [8, 8]]  # i+k+1, clamped to T-1
    # the third position is marked invalid, so none of its steps is supervised
    assert supervised[0].tolist() == [[True, True], [True, True], [False, False]]


def test_draft_chain_over_a_draft_vocabulary_returns_and_stops_on_target_ids():
    """With Vd < V the sampled index is a draft id: the chain must feed back, return and stop on target ids
    (a bug compared the stop set with the draft index)."""
    torch.manual_seed(0)
    ids = torch.arange(1, VOCAB, 2)  # odd target ids only: draft index j is target 2j + 1
    drafter = Eagle3Drafter(
        spec=make_spec(),
        num_feature_layers=M,
        block_size=4,
        embed_tokens=nn.Embedding(VOCAB, HIDDEN),
        lm_head=nn.Linear(HIDDEN, VOCAB, bias=False),
        draft_vocab_ids=ids,
    )
    features, input_ids = make_batch(1, 6)
    greedy = lambda logits: (logits.argmax(-1), torch.softmax(logits, -1))  # noqa: E731
    free = drafter.draft_chain(context_features=features[:, :5], context_ids=input_ids, num_tokens=4, sample_fn=greedy)
    assert free.tokens.shape == (1, 4) and bool((free.tokens % 2 == 1).all())  # target ids, all in Vd
    assert free.probs.shape == (1, 4, VOCAB) and bool((free.probs[..., ::2] == 0).all())  # p_d is 0 outside Vd
    stop = int(free.tokens[0, 1])
    stopped = drafter.draft_chain(
        context_features=features[:, :5], context_ids=input_ids, num_tokens=4, sample_fn=greedy, stop_ids=[stop]
    )
    first = int((free.tokens[0] == stop).nonzero()[0])
    assert stopped.tokens[0].tolist() == free.tokens[0, : first + 1].tolist()
