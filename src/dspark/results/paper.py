"""The paper's claims (the DSpark paper; docs/METHOD.md §9) that results/INDEX.md lists, with our judgement
where a committed report made one and no ledger can regenerate it.

Each claim names the results/ folder that judges it. Once that folder's ledger writes `<sweep>.claims.json`, the
ledger's claims replace these entries (`dspark.results.claims.merged_claims`); until then the numbers here are
transcribed from the folder's committed report (main and head have no ledger: their stores were lost). Those
transcribed verdicts were judged under the earlier rule (± 1.96·SE on the pooled prompt and seed terms, no
degrees of freedom, no Holm correction: `EARLIER_RULE`) and cannot be re-judged under today's
(`dspark.reports.claims`, docs/STATISTICS.md) without their ledgers; each says so in its scope. A sweep never run
says "not run yet"; the losslessness statements of Appendix A are tests, not measurements.
"""

from __future__ import annotations

from dspark.results.claims import NOT_RUN, ONE_SEED, Claim

TEST = "holds (test)"
#: appended to the scope of a verdict transcribed from a report judged before the t / Holm rule
EARLIER_RULE = "; judged under the earlier rule (normal 95% on the pooled SE, no Holm), not re-judged: no ledger"

#: The question each results/ folder answers (a sweep without an entry asks its sweep file's description).
QUESTIONS = {
    "default-run": "What does `make run` (budget=cpu, the default experiment) reach?",
    "cpu-ref": "What does one budget=cpu-ref drafter (the reference sweeps' recipe) reach?",
    "cpu-long": "What does the budget=cpu-long drafter (the decoding benchmark's drafter) reach?",
    "main": "Table 1: how do DSpark, DFlash and EAGLE-3 compare in τ on the nine prompt sets?",
    "head": "§2.2: does a sequential head (Markov, gated, RNN) beat no head, and in which slots?",
    "depth": "Fig. 3: how does τ change with drafter depth, and does a 2-layer DSpark beat a 5-layer DFlash?",
    "block_size": "Fig. 4 left: does DSpark's gain over DFlash grow with the block size γ?",
    "latency": "Fig. 4 right: what share of a decoding round does the sequential loop take?",
    "threshold": "Fig. 5: how does a static confidence threshold trade drafts for verify rate?",
    "calibration": "Fig. 6: does Sequential Temperature Scaling calibrate the confidence head?",
    "objective": "§3: the paper's loss against D-PARD at fixed depth and block size",
    "loss_weights": "§3: which loss weights α_ce, α_tv, α_conf train the best drafter here (Optuna)?",
    "rank": "§2.2: how much Markov rank r does the drafter need here (Optuna)?",
    "serving": "Fig. 7–8: does the hardware-aware scheduler beat MTP-1 under load?",
    "decoding": "How fast does lossless speculative decoding run against target-only decoding on a CPU?",
    "data": "How fast does the data pipeline (regeneration, prefill, feature cache) run?",
    "training": "How fast does a drafter train (blocks per second per step)?",
}


def _claim(
    id: str,
    statement: str,
    paper: str,
    verdict: str,
    *,
    folder: str,
    link: str,
    ours: str = "",
    interval: tuple[float, float, float] | None = None,
    runs: str = "",
    seeds: str = "",
    scope: str = "",
) -> Claim:
    mean, low, high = interval if interval is not None else (None, None, None)
    return Claim(
        id=id,
        statement=statement,
        paper=paper,
        verdict=verdict,
        ours=ours,
        mean=mean,
        low=low,
        high=high,
        runs=runs,
        seeds=seeds,
        scope=scope,
        folder=folder,
        link=link,
    )


def _not_run(id: str, statement: str, paper: str, *, folder: str) -> Claim:
    return _claim(id, statement, paper, NOT_RUN, folder=folder, link=f"{folder}/README.md")


def _test(id: str, statement: str, paper: str, *, tests: str, link: str) -> Claim:
    return _claim(id, statement, paper, TEST, folder="tests", link=link, ours=tests, scope="distribution tests")


PAPER_CLAIMS: tuple[Claim, ...] = (
    # Table 1 (sweep=main; no ledger: transcribed from results/main/main.md)
    _claim(
        "main/dspark-vs-eagle3",
        "Table 1: DSpark's τ above EAGLE-3's (the paper's headline)",
        "+30.9% macro (Qwen3-4B; +26.7 / +30.0% at 8B / 14B)",
        "not resolved",
        folder="main",
        link="main/main.md",
        ours="+0.8% [−3.1%, +4.6%]",
        interval=(0.008, -0.031, 0.046),
        runs="2 vs 2",
        seeds="0, 1",
        scope="all nine sets: here a tie, in every domain" + EARLIER_RULE,
    ),
    _claim(
        "main/dspark-vs-dflash",
        "Table 1: DSpark's τ above DFlash's",
        "+16.3% macro (Qwen3-4B)",
        "holds",
        folder="main",
        link="main/main.md",
        ours="+11.3% [+6.8%, +15.8%]",
        interval=(0.113, 0.068, 0.158),
        runs="2 vs 2",
        seeds="0, 1",
        scope="all nine sets (math +14.7%, code +9.7%, chat +9.4%, each above 0): about two thirds of the paper's size"
        + EARLIER_RULE,
    ),
    _claim(
        "main/dflash-vs-eagle3",
        "Table 1: DFlash's τ above EAGLE-3's",
        "+12.6% macro (Qwen3-4B)",
        "reversed",
        folder="main",
        link="main/main.md",
        ours="−9.4% [−13.2%, −5.7%]",
        interval=(-0.094, -0.132, -0.057),
        runs="2 vs 2",
        seeds="0, 1",
        scope="all nine sets: DFlash's held-out slot 2 is 0.13 against 0.31" + EARLIER_RULE,
    ),
    _claim(
        "main/ordering",
        "Table 1: DSpark > DFlash > EAGLE-3 on every prompt set",
        "9 of 9 sets",
        "not reproduced",
        folder="main",
        link="main/main.md",
        ours="0 of 9 sets (point estimates)",
        runs="2 per drafter",
        seeds="0, 1",
        scope="",
    ),
    # §2.2 sequential head (sweep=head; no ledger: transcribed from results/head/head.md)
    _claim(
        "head/markov-cond2",
        "§2.2 / Fig. 2: the Markov head raises the conditional acceptance of slots k ≥ 2",
        "DSpark's cond@k stays high (math ~0.93) where DFlash decays (code 0.87 → 0.78, chat 0.72 → 0.63)",
        "holds",
        folder="head",
        link="head/head.md",
        ours="cond@2 +0.176 [+0.132, +0.221]",
        interval=(0.176, 0.132, 0.221),
        runs="2 vs 2",
        seeds="0, 1",
        scope="rollout cond@2, Markov vs no head (cond@3 +0.233 [+0.162, +0.303]; slot 1 unchanged)" + EARLIER_RULE,
    ),
    _claim(
        "head/markov-tau",
        "§2.2: a sequential head beats no head in τ (Markov)",
        "both heads beat no head",
        "holds",
        folder="head",
        link="head/head.md",
        ours="+7.9% [+3.9%, +11.9%]",
        interval=(0.079, 0.039, 0.119),
        runs="2 vs 2",
        seeds="0, 1",
        scope="all" + EARLIER_RULE,
    ),
    _claim(
        "head/rnn-tau",
        "§2.2: a sequential head beats no head in τ (RNN)",
        "both heads beat no head",
        "holds",
        folder="head",
        link="head/head.md",
        ours="+7.6% [+3.9%, +11.3%]",
        interval=(0.076, 0.039, 0.113),
        runs="2 vs 2",
        seeds="0, 1",
        scope="all (gated +7.0% [+2.9%, +11.2%])" + EARLIER_RULE,
    ),
    # Fig. 3 depth (sweep=depth: its ledger's claims replace these once regenerated)
    _claim(
        "depth/2-layer-dspark-vs-5-layer-dflash",
        "Fig. 3: a 2-layer DSpark beats a 5-layer DFlash",
        "in every domain (Qwen3-4B)",
        "holds",
        folder="depth",
        link="depth/depth.md",
        ours="+12.8% [+7.6%, +18.1%]",
        interval=(0.128, 0.076, 0.181),
        runs="2 vs 2",
        seeds="0, 1",
        scope="all (math +19.0%, code +11.0%, chat +7.8%, each above 0)",
    ),
    _claim(
        "depth/tau-rises-with-depth",
        "Fig. 3: τ rises with depth (depth 5 vs 1)",
        "monotone, steepest from 1 to 2 layers",
        "not resolved",
        folder="depth",
        link="depth/depth.md",
        ours="−2.0% [−6.6%, +2.6%]",
        interval=(-0.020, -0.066, 0.026),
        runs="2 vs 2",
        seeds="0, 1",
        scope="rollout τ; teacher-forced τ_prob rises to depth 3–4 (+0.025 [+0.001, +0.049])",
    ),
    # Fig. 4 left block size (sweep=block_size: its ledger's claims replace these once regenerated)
    _claim(
        "block_size/gain-grows",
        "Fig. 4 left: DSpark's gain over DFlash grows with γ (γ = 15 minus γ = 3)",
        "+16/15/18% at γ = 7 → +30/26/22% at γ = 15 (math/code/chat)",
        "not resolved",
        folder="block_size",
        link="block_size/block_size.md",
        ours="+0.8% [−5.0%, +6.6%]",
        interval=(0.008, -0.050, 0.066),
        runs="1 vs 1",
        seeds="0",
        scope="rollouts; teacher-forced it grows +3.6% [+3.1%, +4.1%] to γ = 11, flat after",
    ),
    _claim(
        "block_size/dspark-vs-dflash-every-gamma",
        "Fig. 4 left: DSpark beats DFlash at every γ (shown: γ = 15)",
        "at every proposal length",
        ONE_SEED,
        folder="block_size",
        link="block_size/block_size.md",
        ours="+9.7% [+6.1%, +13.4%]",
        interval=(0.097, 0.061, 0.134),
        runs="1 vs 1",
        seeds="0",
        scope="γ = 3 / 7 / 11 / 15: +9.0 / +10.8 / +9.0 / +9.7%, each above 0",
    ),
    _claim(
        "block_size/rnn-vs-markov",
        "Fig. 4 left: the RNN head marginally above Markov at long blocks (γ = 15)",
        "marginal, mainly at longer proposal lengths",
        "not resolved",
        folder="block_size",
        link="block_size/block_size.md",
        ours="+3.3% [−1.0%, +7.5%]",
        interval=(0.033, -0.010, 0.075),
        runs="1 vs 1",
        seeds="0",
        scope="rollouts; teacher-forced −0.3%",
    ),
    # Fig. 7–8 serving (sweep=serving: its ledger's claims replace these once regenerated)
    _claim(
        "serving/user-speed-vs-mtp1",
        "Fig. 7: the scheduler's per-user speed over MTP-1 at matched throughput",
        "1.60–1.85× (V4-Flash), 1.57–1.78× (V4-Pro)",
        "not reproduced",
        folder="serving",
        link="serving/serving.md",
        ours="1.02× median (0.98–1.13×) on the real engine, R = 2–8; 1.27× simulated at R = 16–64",
        runs="28 cells",
        seeds="0",
        scope="medians over matched-throughput points, no interval; the hindsight bound on this trace is 1.16×",
    ),
    _claim(
        "serving/tracks-best-static",
        "Fig. 8: the scheduler tracks the best static verification length",
        "at every concurrency; the budget shrinks as load grows",
        "met (point estimates)",
        folder="serving",
        link="serving/serving.md",
        ours="+6.0 / +1.2 / +0.5 / +4.9% over the best static policy at R = 1/2/4/8",
        runs="28 cells",
        seeds="0",
        scope="serve.scheduler_cost=columns; one run per cell, no interval",
    ),
    # never run
    _not_run(
        "latency/sequential-loop-overhead",
        "Fig. 4 right: the sequential loop's share of a decoding round",
        "+0.2% to +1.3% of round latency (batch 128, contexts 512–4096)",
        folder="latency",
    ),
    _not_run(
        "threshold/verify-rate",
        "Fig. 5: a static confidence threshold lifts the verify rate",
        "76.9 → 92.5% (math), 67.6 → 92.0% (code), 45.7 → 95.7% (chat)",
        folder="threshold",
    ),
    _not_run(
        "calibration/sts-ece",
        "Fig. 6: STS calibrates the cumulative confidence",
        "ECE 5.7 → 2.0, 8.2 → 1.7, 5.8 → 0.8, 3.3 → 0.4% at positions 1/3/5/7 (Alpaca); "
        "AUROC 0.818 / 0.812 / 0.864 / 0.907",
        folder="calibration",
    ),
    # Appendix A and §3.2: losslessness, proven by tests here
    _test(
        "tests/lossless-decoding",
        "§3: speculative decoding is lossless whatever the drafter and the policy",
        "exact (rejection sampling)",
        tests="chi-square tests of every token's PIT under the exact target "
        "conditional, every policy; the test catches a faulty verifier",
        link="../tests/test_lossless.py",
    ),
    _test(
        "tests/lossless-serving",
        "§5: serving R requests at once stays lossless",
        "exact (continuous batching)",
        tests="per-request PIT tests under joins and leaves, every serving policy",
        link="../tests/test_serving_lossless.py",
    ),
    _test(
        "tests/appendix-a",
        "Appendix A: Algorithm 1's early stop keeps scheduling lossless; a full search biases the output",
        "P(A) 0.85 instead of 0.7 without the early stop",
        tests="the paper's counterexample computed exactly: 0.7 with the early stop, 0.85 without",
        link="../tests/test_scheduler.py",
    ),
)
