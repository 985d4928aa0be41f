"""The verify-length headroom replay (`dspark.evaluation.headroom`): a hand-worked case and brute force."""

import itertools
import random

import pytest

from dspark.decoding.records import RoundRecord
from dspark.evaluation.headroom import interpolate_costs, policy_headroom


def _round(accepted: int, *, verified: int = 2, other: float = 0.0, committed: int | None = None) -> RoundRecord:
    return RoundRecord(
        anchor_position=0,
        drafts=[1] * verified,
        confidences=None,
        calibrated=None,
        num_verified=verified,
        num_accepted=accepted,
        committed=accepted + 1 if committed is None else committed,
        extra_token=2,
        seconds_verify=9.0,
        seconds_other=other,
    )  # the fixed run's verify time is replaced


def test_hand_worked_case():
    # one round accepts nothing, one accepts both drafts; verifying costs 1 / 1.5 / 2 s at ℓ = 0 / 1 / 2
    rounds = [_round(0), _round(2)]
    head = policy_headroom(rounds, verify_seconds={0: 1.0, 1: 1.5, 2: 2.0}, block_size=2)
    assert head.static_rates == pytest.approx({1: 3 / 3.0, 2: 4 / 4.0})
    # hindsight: verify nothing in the first round (1 token, 1 s), both drafts in the second (3 tokens, 2 s)
    assert head.hindsight_rate == pytest.approx(4 / 3)
    assert head.best_static == 1 and head.ratio == pytest.approx(4 / 3)


def test_flat_verify_cost_leaves_no_headroom():
    rounds = [_round(0, other=0.3), _round(1, other=0.2), _round(2, other=0.4)]
    head = policy_headroom(rounds, verify_seconds={0: 1.0, 2: 1.0}, block_size=2)
    assert head.best_static == 2 and head.ratio == pytest.approx(1.0)


def test_hindsight_matches_brute_force_over_every_choice():
    rng = random.Random(0)
    for _ in range(30):
        gamma = 3
        costs = {0: 1.0, 1: 1.0 + rng.random(), 3: 2.5 + rng.random()}
        rounds = []
        for _ in range(4):
            verified = rng.randint(1, gamma)
            accepted = rng.randint(0, verified)
            stop = accepted == verified and rng.random() < 0.3  # an accepted stop id: τ = A, no extra token
            rounds.append(_round(accepted, verified=verified, other=rng.random(), committed=accepted if stop else None))
        head = policy_headroom(rounds, verify_seconds=costs, block_size=gamma)
        table = interpolate_costs(costs, gamma)
        options = [
            [
                ((ell + 1) if ell < r.num_accepted else r.committed, r.seconds - r.seconds_verify + table[ell])
                for ell in range(r.num_verified + 1)
            ]
            for r in rounds
        ]
        best = max(sum(t for t, _ in pick) / sum(s for _, s in pick) for pick in itertools.product(*options))
        assert head.hindsight_rate == pytest.approx(best, rel=1e-9)
        assert head.ratio >= 1.0 - 1e-12


def test_interpolation_and_bad_input():
    assert interpolate_costs({0: 1.0, 2: 3.0}, 4) == pytest.approx([1.0, 2.0, 3.0, 3.0, 3.0])
    with pytest.raises(ValueError, match="ℓ = 0"):
        interpolate_costs({1: 1.0, 2: 2.0}, 2)
    with pytest.raises(ValueError, match="at least one round"):
        policy_headroom([], verify_seconds={0: 1.0, 1: 1.0}, block_size=1)
