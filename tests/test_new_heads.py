"""The Domino-style GRU head, the DFlash2-style selector with its block convolution, their parameter budget, and
D-PACE's position weights (METHOD §2.2, §3).

The generic head contracts (non-anticipation, rank 0 = DFlash, lossless decoding, export refusals, greedy trees) reach
these heads through the registry in tests/test_dspark_drafter.py, tests/test_lossless.py, tests/test_interop.py and
tests/test_tree_engine.py; this file holds what is particular to them: the GRU is `nn.GRUCell`'s, the selector's
bias lives on the K best parallel candidates only and reads U_k, the convolution never crosses a block and is what
the cached decoder computes, the per-slot `step` path gives the teacher-forced q (including down a tree's branches),
gradients reach every new weight, the parameter count and the matched rank are right, and `loss.position_weights`
leaves the paper's objective untouched by default.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_dspark_drafter import GAMMA, MASK_ID, VOCAB, M, frozen_modules, make_inputs, run, tiny_spec

from dspark.decoding import DSparkProposer
from dspark.decoding.tree_proposers import DSparkTreeExpander
from dspark.drafters import DSparkDrafter, DSparkOutput
from dspark.drafters.block_conv import BlockConv
from dspark.drafters.factory import drafter_spec_for
from dspark.drafters.heads import GRUHead, SelectorConvHead, head_parameter_count, matched_rank
from dspark.losses import compute_dspark_loss
from dspark.losses.dspark import dpace_position_weights, supervised_weights

NEW_HEADS = ("gru", "selector_conv")
ALPHAS = dict(alpha_ce=0.1, alpha_tv=0.9, alpha_conf=1.0)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one thread (tests/conftest.py)


def make_drafter(head: str, *, rank: int = 6, seed: int = 0, draft_vocab_ids=None, scale: float = 0.3):
    """A tiny drafter (tests/test_dspark_drafter.py's target) with every weight redrawn — the convolutions too, so
    they are far from the identity they start at."""
    embed, lm_head = frozen_modules()
    torch.manual_seed(seed + 1)
    drafter = DSparkDrafter(
        spec=tiny_spec(),
        num_feature_layers=M,
        depth=2,
        block_size=GAMMA,
        head=head,
        markov_rank=rank,
        confidence=True,
        embed_tokens=embed,
        lm_head=lm_head,
        mask_token_id=MASK_ID,
        draft_vocab_ids=draft_vocab_ids,
    )
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    return drafter.eval()


def step_through(drafter, out: DSparkOutput, prev: torch.Tensor) -> tuple[list, list]:
    """The per-slot path over a teacher-forced block: (logits, confidence logits) of every slot."""
    state, logits, confs = drafter.head.init_state(prev.shape[:-1]), [], []
    with torch.no_grad():
        for k in range(GAMMA):
            step_logits, conf, state = drafter.sequential_step(
                hidden_k=out.hidden[..., k, :],
                parallel_logits_k=out.parallel_logits[..., k, :],
                prev_token=prev[..., k],
                state=state,
            )
            logits.append(step_logits)
            confs.append(conf)
    return logits, confs


# ---- the heads ----


def test_the_gru_update_is_torchs_gru_cell():
    """Our batched update (any batch shape, input part precomputed) is `nn.GRUCell`'s on the same weights."""
    torch.manual_seed(0)
    head = GRUHead(hidden_size=8, vocab_size=30, rank=5)
    with torch.no_grad():
        for p in head.cell.parameters():
            p.copy_(torch.randn_like(p))  # the N(0, 0.02) start would hide a gate-order slip
    tokens, state = torch.randint(0, 30, (3, 4)), torch.randn(3, 4, 5)
    ours = head._update(head._input_part(tokens), state)
    reference = head.cell(head.w1(tokens).flatten(0, 1), state.flatten(0, 1)).view(3, 4, 5)
    torch.testing.assert_close(ours, reference)


@pytest.mark.parametrize("head", NEW_HEADS)
@pytest.mark.parametrize("vocab", ["full", "draft"])
def test_the_step_path_gives_the_teacher_forced_distribution(head, vocab):
    """Drafting slot by slot through `step` (state carried, U_k passed) gives the q_k and c_k of the teacher-forced
    forward over the block: what the verifier is told is what the loss trained. With a draft vocabulary every
    logits row has Vd columns and the selector's candidates are draft ids."""
    ids = torch.arange(0, VOCAB - 1, 2) if vocab == "draft" else None  # Vd = 48 of the 97 ids
    drafter, inputs = make_drafter(head, draft_vocab_ids=ids), make_inputs()
    out = run(drafter, inputs)
    assert out.logits.shape[-1] == (VOCAB if ids is None else ids.numel())
    assert not torch.allclose(out.logits, out.parallel_logits)  # the head does correct the parallel logits
    logits, confs = step_through(drafter, out, inputs["prev_tokens"])
    for k in range(GAMMA):
        torch.testing.assert_close(logits[k], out.logits[..., k, :], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(confs[k], out.confidence_logits[..., k], atol=1e-5, rtol=1e-5)


def test_the_selector_bias_is_the_pair_score_on_the_top_k_candidates_only():
    """B_k(v) = W_2[v]·(W_1[x_{k-1}] ⊙ (H h_k + b)) on the K best U_k entries, 0 elsewhere: q_k keeps full support,
    and U_k acts only through which entries are the candidates (a shift of U_k changes nothing)."""
    torch.manual_seed(0)
    head = SelectorConvHead(hidden_size=8, vocab_size=40, rank=4)
    hidden, prev, parallel = torch.randn(5, 8), torch.randint(0, 40, (5,)), torch.randn(5, 40)
    with torch.no_grad():
        bias, state = head.step(hidden, prev, None, parallel_logits=parallel)
        assert state is None
        for row in range(5):
            top = set(parallel[row].topk(SelectorConvHead.TOP_K).indices.tolist())
            query = head.w1.weight[prev[row]] * (head.context.weight @ hidden[row] + head.context.bias)
            for v in range(40):
                expected = float(head.w2.weight[v] @ query) if v in top else 0.0
                assert float(bias[row, v]) == pytest.approx(expected, abs=1e-6)
        shifted, _ = head.step(hidden, prev, None, parallel_logits=parallel + 3.0)
    torch.testing.assert_close(shifted, bias)
    with pytest.raises(ValueError, match="selector_conv reads the parallel logits"):
        head.step(hidden, prev, None)


def test_the_gru_state_does_not_read_the_hidden_states():
    """Domino's recurrence is over the previous tokens alone: h_k enters at the read-out only."""
    torch.manual_seed(0)
    head = GRUHead(hidden_size=8, vocab_size=30, rank=5)
    prev = torch.tensor([3, 7])
    _, state_a = head.step(torch.randn(2, 8), prev, None)
    _, state_b = head.step(torch.randn(2, 8), prev, None)
    torch.testing.assert_close(state_a, state_b)


@pytest.mark.parametrize("head", NEW_HEADS)
def test_gradients_reach_every_new_weight(head):
    """One loss backward reaches W_1, W_2 and the head's own layers, and for the selector the block convolutions —
    whose dynamic projection starts at zero, so it must learn from a zero start."""
    drafter, inputs = make_drafter(head), make_inputs()
    for conv in (m for m in drafter.modules() if isinstance(m, BlockConv)):
        conv.reset_parameters()  # the identity start, as training begins
    drafter.train()
    out = drafter(**inputs)
    labels = torch.randint(0, VOCAB, inputs["prev_tokens"].shape)
    loss = compute_dspark_loss(
        out,
        labels=labels,
        label_valid=torch.ones_like(labels, dtype=torch.bool),
        target_probs=torch.softmax(torch.randn(*labels.shape, VOCAB), -1),
        **ALPHAS,
        decay=4.0,
    )
    loss.total.backward()
    new = {n: p for n, p in drafter.named_parameters() if n.startswith("head.") or "_conv." in n}
    assert any("_conv." in n for n in new) == (head == "selector_conv")
    for name, param in new.items():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


# ---- the block convolution ----


def test_a_fresh_block_convolution_is_the_identity_and_never_crosses_a_block():
    torch.manual_seed(0)
    conv, x = BlockConv(32), torch.randn(2, 3 * GAMMA, 32)
    sublayer = torch.nn.Linear(32, 32)
    torch.testing.assert_close(conv.wrap(sublayer, x, block_size=GAMMA), sublayer(x), atol=0, rtol=0)
    with torch.no_grad():
        conv.static.normal_()
        conv.dynamic.weight.normal_()
    base = conv.wrap(sublayer, x, block_size=GAMMA)
    moved = x.clone()
    moved[:, GAMMA : 2 * GAMMA] += 1.0  # block 2 of 3
    out = conv.wrap(sublayer, moved, block_size=GAMMA)
    assert torch.equal(out[:, :GAMMA], base[:, :GAMMA]) and torch.equal(out[:, 2 * GAMMA :], base[:, 2 * GAMMA :])
    assert not torch.allclose(out[:, GAMMA : 2 * GAMMA], base[:, GAMMA : 2 * GAMMA])
    # one block per row, as the cached decoder calls it: the same numbers as the batched call
    torch.testing.assert_close(conv.wrap(sublayer, x[:, GAMMA : 2 * GAMMA]), base[:, GAMMA : 2 * GAMMA])


def test_the_cached_decoder_computes_the_training_block_forward():
    """DSparkProposer's block forward (cached context keys/values, `forward_cached`, one block) gives the hidden
    states of the batched teacher-forced forward, convolutions included."""
    drafter = make_drafter("selector_conv")
    g = torch.Generator().manual_seed(3)
    features = torch.randn(1, 9, M * drafter.spec.hidden_size, generator=g)
    proposer = DSparkProposer(drafter)
    proposer.start(features=features, token_ids=list(range(9)))
    block = torch.full((1, 1, GAMMA), MASK_ID)
    block[0, 0, 0] = 5
    with torch.no_grad():
        expected = drafter.backbone(features, block_input_ids=block, anchor_positions=torch.tensor([[9]]))[0, 0]
        torch.testing.assert_close(proposer.block_hidden(5, 9), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head", NEW_HEADS)
def test_a_tree_branch_gives_the_chain_distribution(head):
    """Each tree node's children read U_d plus the head's correction from the node's own token and carried state:
    any root-to-leaf path's logits are the chain's for that path."""
    drafter = make_drafter(head)
    g = torch.Generator().manual_seed(1)
    features = torch.randn(1, 9, M * drafter.spec.hidden_size, generator=g)
    proposer = DSparkProposer(drafter)
    proposer.start(features=features, token_ids=list(range(9)))
    with torch.no_grad():
        expander = DSparkTreeExpander(proposer, anchor_token=5, anchor_position=9, depth=3)
        first = expander.expand([-1], [-2], [5], 1)  # the anchor's children
        children = first[0].topk(2).indices.tolist()
        second = expander.expand([0, 1], [-1, -1], children, 2)
        grandchild = second[1].argmax().item()
        third = expander.expand([2], [1], [grandchild], 3)
        hidden, parallel = expander.hidden, expander.base
        state, prev = None, torch.tensor([5])
        for k, (tree_row, token) in enumerate(zip([first[0], second[1], third[0]], [children[1], grandchild, None])):
            chain, _, state = drafter.sequential_step(
                hidden_k=hidden[k : k + 1], parallel_logits_k=parallel[k : k + 1], prev_token=prev, state=state
            )
            torch.testing.assert_close(tree_row, chain[0], atol=1e-5, rtol=1e-5)
            prev = torch.tensor([token]) if token is not None else prev


TINY_TARGET = {"seed": 1}  # the `tiny` fixture's options (tests/conftest.py), as tests/test_tree_engine.py


@pytest.fixture(scope="module")
def target(tiny):
    with torch.no_grad():
        tiny.model.get_decoder().norm.weight.mul_(12.0)  # peaked p_t (tests/test_lossless.py)
    return tiny


@pytest.mark.parametrize("head", NEW_HEADS)
def test_sampled_trees_stay_lossless(target, head):
    """tests/test_tree_engine.py's distribution test on a sampled branching tree (rrsw): the GRU's state is carried
    down every branch, the selector reads each depth's U_d; the output is still the target's distribution."""
    from test_tree_engine import P_MIN, chi_square, sample

    prompt = target.chat_prompt_ids("What is 2+2?")
    results = sample(target, prompt, f"dspark-{head}", "branching-rrsw")
    assert any(r.num_accepted > 0 for result in results for r in result.rounds)
    assert min(chi_square(target, prompt, results).values()) > P_MIN


# ---- parameter budget ----


@pytest.mark.parametrize("head", ["none", "markov", "gated", "rnn", *NEW_HEADS])
def test_the_parameter_count_is_what_the_head_adds_to_the_drafter(head):
    """head_parameter_count = the built drafter's head weights plus its block convolutions (selector_conv)."""
    drafter = make_drafter(head, draft_vocab_ids=torch.arange(40))
    own = sum(p.numel() for p in drafter.head.parameters())
    convs = sum(p.numel() for n, p in drafter.named_parameters() if "_conv." in n)
    dims = dict(hidden_size=drafter.spec.hidden_size, vocab_size=VOCAB, output_size=40)
    assert head_parameter_count(head, rank=6, depth=2, **dims) == own + convs
    assert head_parameter_count(head, rank=6, **dims) == own  # depth 0: the head alone
    assert (convs > 0) == (head == "selector_conv")


@pytest.mark.parametrize("head", ["markov", "gated", "rnn", *NEW_HEADS])
def test_the_matched_rank_spends_the_markov_budget(head):
    dims = dict(hidden_size=576, vocab_size=49152, output_size=8192, depth=2)  # SmolLM2 at budget=cpu
    budget = head_parameter_count("markov", rank=256, **dims)
    rank = matched_rank(head, rank=256, **dims)
    assert head_parameter_count(head, rank=rank, **dims) <= budget < head_parameter_count(head, rank=rank + 1, **dims)
    assert (rank == 256) == (head == "markov")
    assert matched_rank("none", rank=256, **dims) == 256


def test_a_budget_no_rank_fits_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="model.match_params"):
        matched_rank("selector_conv", rank=1, hidden_size=512, vocab_size=16, depth=8)


def test_match_params_sizes_the_spec_of_a_new_drafter():
    target = SimpleNamespace(
        layer_spec=tiny_spec(),
        vocab_size=VOCAB,
        feature_layer_ids=[1, 2],
        mask_token_id=MASK_ID,
        fingerprint="f" * 16,
    )
    model = SimpleNamespace(head="gru", depth=2, block_size=GAMMA, markov_rank=16, draft_vocab_size=0)
    assert drafter_spec_for(kind="dspark", model_cfg=model, target=target).markov_rank == 16
    model.match_params = True
    spec = drafter_spec_for(kind="dspark", model_cfg=model, target=target)
    assert spec.markov_rank == matched_rank("gru", rank=16, hidden_size=32, vocab_size=VOCAB, depth=2) < 16


# ---- D-PACE ----


def test_dpace_weights_are_the_credit_of_each_slot_in_the_expected_accepted_length():
    """w_k = ∂/∂ log q̃_k of Σ_j Π_{i ≤ j} q̃_i (the smoothed expected accepted length), 0 past the valid prefix."""
    q = torch.tensor([[[0.9, 0.2, 0.7, 0.5], [0.3, 0.8, 0.6, 0.1]]])
    valid = torch.tensor([[[True, True, True, True], [True, True, False, False]]])
    alpha = 0.3
    weights = dpace_position_weights(q, valid, alpha=alpha)
    for n, length in enumerate((4, 2)):
        log_smooth = torch.log((1 - alpha) * q[0, n, :length] + alpha).requires_grad_()
        torch.cumprod(log_smooth.exp(), dim=0).sum().backward()
        torch.testing.assert_close(weights[0, n, :length], log_smooth.grad)
        assert torch.all(weights[0, n, length:] == 0)
    certain = dpace_position_weights(torch.ones(1, 1, GAMMA), torch.ones(1, 1, GAMMA, dtype=torch.bool), alpha=alpha)
    torch.testing.assert_close(certain[0, 0], torch.arange(GAMMA, 0, -1).float())  # all accepted: γ − k + 1
    with pytest.raises(ValueError, match="loss.dpace_alpha"):
        dpace_position_weights(q, valid, alpha=0.0)


def random_output(seed: int = 0, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    shape = (2, 3, GAMMA)
    logits = (2 * torch.randn(*shape, vocab, generator=g)).requires_grad_()
    conf = torch.randn(*shape, generator=g).requires_grad_()
    out = DSparkOutput(hidden=torch.zeros(*shape, 4), parallel_logits=logits, logits=logits, confidence_logits=conf)
    lengths = torch.randint(0, GAMMA + 1, (2, 3), generator=g)
    supervision = dict(
        labels=torch.randint(0, vocab, shape, generator=g),
        label_valid=torch.arange(GAMMA) < lengths.unsqueeze(-1),
        target_probs=torch.softmax(3 * torch.randn(*shape, vocab, generator=g), dim=-1),
        label_in_vocab=torch.rand(shape, generator=g) > 0.2,
    )
    return out, supervision


def test_the_default_position_weights_are_the_papers_decay_exactly():
    """loss.position_weights defaults to decay, and decay is today's objective bit for bit (value and gradient)."""
    from dspark.config.schema import LossConfig

    assert LossConfig().position_weights == "decay"
    out, sup = random_output()
    plain = compute_dspark_loss(out, **sup, **ALPHAS, decay=2.0)
    (plain_grad,) = torch.autograd.grad(plain.total, out.logits)
    explicit = compute_dspark_loss(out, **sup, **ALPHAS, decay=2.0, position_weights="decay", dpace_alpha=0.9)
    (explicit_grad,) = torch.autograd.grad(explicit.total, out.logits)
    assert torch.equal(plain.total, explicit.total) and torch.equal(plain_grad, explicit_grad)


def test_the_dpace_objective_weights_every_term_by_the_detached_credit():
    """Σ w·ℓ / Σ w with w from the drafter's own p_d(x*) (0 for a label outside Vd), detached: the gradient is the
    per-slot terms' gradient times w, never a gradient through w."""
    out, sup = random_output(1)
    loss = compute_dspark_loss(out, **sup, **ALPHAS, decay=4.0, position_weights="dpace", dpace_alpha=0.5)
    valid = sup["label_valid"]
    log_q = torch.log_softmax(out.logits.detach(), -1).gather(-1, sup["labels"].unsqueeze(-1)).squeeze(-1)
    q = torch.where(sup["label_in_vocab"], log_q.exp(), 0.0) * valid
    weights = dpace_position_weights(q, valid, alpha=0.5)[valid]
    nll = -torch.log_softmax(out.logits, -1).gather(-1, sup["labels"].unsqueeze(-1)).squeeze(-1)[valid]
    ce = (weights * torch.where(sup["label_in_vocab"][valid], nll, 0.0)).sum() / weights.sum()
    torch.testing.assert_close(loss.ce, ce)
    (grad,) = torch.autograd.grad(loss.ce, out.logits)
    (expected,) = torch.autograd.grad(ce, out.logits)
    torch.testing.assert_close(grad, expected)
    decay = compute_dspark_loss(out, **sup, **ALPHAS, decay=4.0)
    assert not torch.allclose(loss.total, decay.total)


def test_an_unknown_position_weight_scheme_names_the_key():
    with pytest.raises(ValueError, match="loss.position_weights='linear'"):
        supervised_weights(
            "linear",
            label_valid=torch.ones(1, 1, 2, dtype=torch.bool),
            nll=torch.ones(2),
            label_in_vocab=None,
            decay=4.0,
            dpace_alpha=0.5,
        )
