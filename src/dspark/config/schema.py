"""Typed configuration schema: every public `key=value` of `experiments/run.py` is a field here.

Precedence (lowest → highest): these defaults < `experiments/default.yaml` < `experiments/budgets/<budget>.yaml`
< sweep cell overrides < command-line `key=value`. `validate_config` re-runs after all merges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dspark.config.ranges import quote, range_errors, ranged

DRAFTERS = ("dspark", "dflash", "eagle3")
HEADS = ("markov", "gated", "rnn", "gru", "selector_conv", "none")
LOSS_KINDS = ("paper", "dpard")
POSITION_WEIGHTS = ("decay", "dpace")  # loss.position_weights (dspark.losses.dspark.POSITION_WEIGHTS)
# What a drafter kind fixes whatever model.head says (the one place that says it): DFlash is DSpark without the
# sequential and the confidence head (METHOD §3); EAGLE-3 drafts autoregressively, with neither. None: model.head.
FIXED_HEAD = {"dspark": None, "dflash": "none", "eagle3": "none"}
CONFIDENCE_HEAD = {"dspark": True, "dflash": False, "eagle3": False}
EXPORT_LAYOUTS = ("deepspec", "speculators")  # dspark.interop.layouts.LAYOUTS
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
TARGET_DTYPES = EXPORT_DTYPES  # target_options.dtype and serve.target_dtype
BUDGETS = ("smoke", "cpu", "cpu-ref", "cpu-long", "paper")
RESPONSE_MODES = ("regenerate", "reference", "mix")
STAGES = ("prepare", "train", "eval", "all", "report", "profile", "serve", "export")
# One policy family for decode.policy and serve.policy (dspark.decoding.policies; tests pin the two lists equal).
POLICIES = ("fixed", "mtp1", "static", "threshold", "calibrated_threshold", "scheduler", "async")
SERVE_POLICIES = POLICIES
PRECISIONS = ("auto", "fp32", "bf16", "int8")  # decode.drafter_precision (dspark.decoding.drafting)
SAMPLERS = ("generate", "lean")  # data.sampling.sampler (dspark.data.regenerate)
STEP_OVERHEADS = ("none", "measured")  # serve.step_overhead (dspark.serving.engine)
STEP_COSTS = ("profile", "measured")  # decode.step_costs (dspark.decoding.engine)
SCHEDULER_COSTS = ("tokens", "columns")  # serve.scheduler_cost (dspark.decoding.policies.SchedulerPolicy)
# decode.scheduler_stop / serve.scheduler_stop (dspark.scheduling.scheduler): Algorithm 1's stop (lossless) or the
# argmax of Θ over the whole staircase (TensorRT-LLM's; biased, paper Appendix A: runs say "lossy")
SCHEDULER_STOPS = ("first_non_improvement", "global_argmax")
VERIFIERS = ("token", "block")  # decode.verifier / serve.verifier (dspark.decoding.verify.VERIFIERS; a test pins them)
BYPASS_MODES = ("off", "cost")  # decode.bypass (dspark.decoding.engine)
SPS_FORWARDS = ("plain", "engine")  # serve.sps_forward (dspark.serving.profile)
# the policies that read the confidence head's c_k (their classes say needs_confidences = True; a test pins this);
# only drafters with CONFIDENCE_HEAD can run them, offline (decode.policy) or served (serve.policy)
TREE_SHAPES = ("chain", "widths", "branching", "dynamic")  # decode.tree.shape (dspark.decoding.tree.TREE_SHAPES)
TREE_SCHEMES = ("descent", "rrsw")  # decode.tree.scheme (dspark.decoding.tree_verify.TREE_SCHEMES)
CONFIDENCE_POLICIES = ("threshold", "calibrated_threshold", "scheduler", "async")
# of those, the ones that read calibrated c̃_k (policies' `reads`; a test pins the two equal): without a calibration
# they run on raw c_k, which a run states loudly (calibrated_threshold without one is refused: its name says c̃_k)
CALIBRATED_POLICIES = ("calibrated_threshold", "scheduler", "async")
SERVE_CONFIDENCE_POLICIES = CONFIDENCE_POLICIES
# decode.confidence / serve.confidence (dspark.decoding.confidence.CONFIDENCE_SOURCES; a test pins the two equal);
# the sources after "head" need no confidence head, so every drafter can run the confidence policies with them
CONFIDENCE_SOURCES = ("head", "draft_max_prob", "online")
# Upper bounds of the structural sizes: far past any published drafter, well short of what fills a machine's memory
# (a typo such as model.depth=100000 is refused at once instead of while the drafter is being built)
SEED_MAX = 2**32 - 1  # numpy's and Lightning's seed range (Lightning silently replaces a larger seed by 0)
MAX_LAYERS = 256  # target decoder layers: the deepest released transformers have ~130
MAX_BLOCK = 64  # γ: DFlash and the paper use at most 16
MAX_RANK = 8192  # r of the V × r Markov table: the paper sweeps 16–512
MAX_VOCAB = 2**20  # vocabulary sizes: the largest tokenizers have ~262k tokens
MAX_TREE_NODES = 4096  # tree nodes one verify forward scores


def drafter_head(drafter: str, head: str) -> str:
    """The sequential head of a `drafter` (dspark | dflash | eagle3) drafter when model.head is `head`."""
    fixed = FIXED_HEAD[drafter]
    return head if fixed is None else fixed


@dataclass
class PathsConfig:
    #: every output of a run goes under root (MLflow store, caches, checkpoints, reports); "" = <repo>/outputs
    root: str = ""
    #: where markdown reports go; "" = <root>/reports (a run never writes into the tracked tree)
    reports: str = ""


@dataclass
class TargetConfig:
    trust_remote_code: bool = False  #: off unless you trust the model repository's code
    #: override the reserved MASK row (METHOD §2.1); None = automatic
    mask_token_id: Optional[int] = ranged(None, ge=0, note="a token id; null = automatic", example="null")
    #: float32 | bfloat16 | float16; on AMX-BF16 CPUs bf16 verifies 2–8 tokens for ~one step's cost
    #: (benchmarks/results/decoding*.md); on CPUs without bf16 instructions bf16 is slower than fp32. Drafters serve any dtype
    dtype: str = "float32"


@dataclass
class ModelConfig:
    #: sequential head: markov | gated | rnn | gru | selector_conv | none (METHOD §2.2); drafter=dflash forces none
    head: str = "markov"
    depth: int = ranged(5, ge=1, le=MAX_LAYERS)  #: draft decoder layers (paper 5)
    block_size: int = ranged(7, ge=1, le=MAX_BLOCK)  #: γ, drafts per round (paper 7)
    #: r of the Markov/RNN head (paper 256); 0 = no head (DFlash logits exactly)
    markov_rank: int = ranged(256, ge=0, le=MAX_RANK, note="0 = no head")
    num_feature_layers: int = ranged(5, ge=1, le=MAX_LAYERS)  #: m, used when feature_layers is empty
    #: target layer ids; [] = METHOD §2.1 default
    feature_layers: list[int] = ranged(factory=list, ge=0, lt=MAX_LAYERS, note="[] = the default layers")
    #: Vd, predict over the Vd most frequent training tokens only (EAGLE-3's draft_vocab_size); 0 = full vocabulary
    draft_vocab_size: int = ranged(0, ge=0, le=MAX_VOCAB, note="0 = full vocabulary")
    #: the confidence head also reads the Markov previous-token embedding W_1[x_{k-1}] (DeepSpec's default)
    confidence_with_markov: bool = True
    #: target decoder layer ids whose weights initialise the draft layers, one per layer in order (negative ids count
    #: from the end; the fusion, mask embedding and heads stay randomly initialised); [] = random initialisation
    init_layers: list[int] = ranged(
        factory=list, ge=-MAX_LAYERS, lt=MAX_LAYERS, note="negative ids count from the end; [] = random weights"
    )
    #: a drafter checkpoint directory (DeepSpec / vLLM / speculators layout, or stage=export's output) evaluated or
    #: served instead of training one; "" = train (docs/INTEROP.md)
    import_from: str = ""
    #: size the head's rank so that it adds at most the Markov head's parameters at markov_rank (the parameter-matched
    #: variant of a head; dspark.drafters.heads.matched_rank); false = every head at markov_rank
    match_params: bool = False


@dataclass
class LossConfig:
    #: α_ce, weight of the cross-entropy to the target's token (METHOD §3; paper 0.1)
    alpha_ce: float = ranged(0.1, ge=0)
    alpha_tv: float = ranged(0.9, ge=0)  #: α_tv, weight of the L1 distance ‖p_d − p_t‖₁ (paper 0.9)
    alpha_conf: float = ranged(1.0, ge=0)  #: α_conf, weight of the confidence head's BCE against c* (paper 1.0)
    decay: float = ranged(4.0, gt=0)  #: γ_w of the position weights exp(-(k-1)/γ_w); 4 produced Table 1
    #: paper = α_ce·CE + α_tv·L1 + α_conf·BCE (METHOD §3); dpard = speculators' D-PARD (Rényi-½ actor with
    #: detached acceptance-derived position weights, reach-weighted confidence BCE; alpha_ce/alpha_tv/decay unused)
    kind: str = "paper"
    dpard_alpha: float = ranged(0.5, gt=0, le=1)  #: D-PARD's smoothing α ∈ (0, 1] of the position-credit recurrence
    #: kind=paper's position weights: decay = exp(-(k-1)/decay) (the paper) | dpace = D-PACE's confidence-adaptive
    #: weights from the drafter's own detached p_d(x*_k) (METHOD §3)
    position_weights: str = "decay"
    dpace_alpha: float = ranged(0.5, gt=0, le=1)  #: D-PACE's smoothing α ∈ (0, 1] of the confidences (paper 0.5)


@dataclass
class SamplingConfig:
    """How the target regenerates training responses (METHOD §3; DeepSpec's recommended T 0.7, top-p 0.8, top-k 20,
    min-p 0). The one sampling record: the config group `data.sampling` and what `dspark.data.regenerate` samples
    with. Temperature 0 means greedy decoding. A value out of range is refused on construction."""

    temperature: float = ranged(0.7, ge=0, note="0 = greedy")  #: T of regeneration (0 = greedy)
    top_p: float = ranged(0.8, gt=0, le=1, note="1 = off")  #: nucleus mass kept (1 = off)
    top_k: int = ranged(20, ge=0, note="0 = off")  #: most likely tokens kept (0 = off)
    max_new_tokens: int = ranged(256, ge=1)  #: cap on each regenerated response
    batch_size: int = ranged(8, ge=1)  #: prompts regenerated together
    system_prompt: Optional[str] = None  #: None = whatever the target's chat template does by default
    #: generate = transformers' `generate`; lean = our own loop (`dspark.data.regenerate.sample_lean`): the same
    #: distribution (same processors, in the same order), drawn with one uniform per row by inverse CDF instead of
    #: torch.multinomial, finished rows dropped from the batch and its KV cache; a different random stream, so part
    #: of the cache key only when it is lean
    sampler: str = "generate"

    def __post_init__(self) -> None:
        errors = range_errors(self, "data.sampling.")
        if self.sampler not in SAMPLERS:
            errors.append(f"data.sampling.sampler={quote(self.sampler)} must be one of {', '.join(SAMPLERS)}")
        if errors:
            raise ValueError("; ".join(errors))


@dataclass
class DataConfig:
    train_sets: list[str] = field(default_factory=lambda: ["synthetic"])  #: prompt sets to train on
    #: per-set sampling weights, in train_sets order ([] = round-robin, equal shares)
    train_weights: list[float] = ranged(factory=list, ge=0, note="[] = equal shares")
    #: prompts drawn (over train_sets, by train_weights)
    num_train_prompts: int = ranged(240, ge=2, note="one is held out for validation")
    #: regenerate (the target writes every response, the paper) | reference (the sets' own responses; fast)
    #: | mix (num_regen_prompts regenerated + the rest reference)
    responses: str = "regenerate"
    num_regen_prompts: int = ranged(0, ge=0)  #: responses=mix: how many of the prompts the target regenerates
    #: the data's own seed (prompt sample, regenerated responses, train/val/calibration split); None = `seed`. Fixed,
    #: a sweep's seed replicates differ in initialisation, anchors and order only, and share one data cache and one
    #: held-out split (budget=cpu-ref)
    seed: Optional[int] = ranged(None, ge=0, le=SEED_MAX, note="null = the run's seed", example="0")
    feature_precision: str = (
        "auto"  #: target prefill for the feature cache: auto (bf16 on AMX/AVX512-BF16 CPUs) | bf16 | fp32
    )
    regen_precision: str = (
        "auto"  #: the target while it regenerates responses: auto (as feature_precision) | bf16 | fp32
    )
    local_dir: Optional[str] = None  #: directory of JSONL prompt files (schema of shared/data); wins over the hub
    #: truncate regenerated sequences (tokens)
    max_length: int = ranged(1024, ge=2, note="a sequence holds a prompt and a response token")
    val_fraction: float = ranged(0.05, gt=0, lt=1)  #: sequences held out for validation (val/* metrics)
    #: sequences held out for STS calibration (0 = none: no threshold calibration)
    calib_fraction: float = ranged(0.05, ge=0, lt=1, note="0 = no calibration split")
    max_anchors: int = ranged(64, ge=1)  #: K, anchors per sequence per epoch (DeepSpec 512)
    batch_size: int = ranged(4, ge=1)  #: sequences per micro-batch
    cache_features: bool = True  #: store target features once instead of recomputing them every epoch
    #: train on features an external capture job wrote in the format of docs/FEATURES.md (a directory with
    #: manifest.json and features-NNNNN.safetensors): no regeneration and no target prefill; checked against the target
    #: before any work. null = prepare the data here (data.responses, data.cache_features)
    features_from: Optional[str] = None
    #: which user turns the target answers (dspark.data.regenerate): off = the first only | dataset = the prompt's own
    #: later turns too (mt-bench's second turn) | followup = as dataset, and a prompt without later turns gets one
    #: follow-up user turn: the first turn of another prompt of the same domain among those regenerated, drawn by
    #: the data seed. Every assistant turn is trained on
    multi_turn: str = "dataset"
    #: who writes the regenerated responses: hf = the target in this process (transformers generate / data.sampling
    #: .sampler) | openai = an OpenAI-compatible server at data.regen_url (vLLM, SGLang, llama.cpp's server,
    #: transformers serve) serving the target's model; its text is re-tokenised by the target (dspark.data.regen_server)
    regen_backend: str = "hf"
    #: regen_backend=openai: the API base URL, e.g. http://127.0.0.1:8000/v1 (credentials in it are masked in records)
    regen_url: str = ""
    #: regen_backend=openai: chat = /chat/completions with the messages (the server's chat template) | completions =
    #: /completions with the prompt templated by the target's tokenizer here
    regen_api: str = "chat"
    regen_model: Optional[str] = None  #: regen_backend=openai: the model to request; None = the server's first listed
    #: regen_backend=openai: NAME of the environment variable holding the API key ("" = no key); never the key itself
    regen_api_key_env: str = ""
    regen_concurrency: int = ranged(4, ge=1, le=1024)  #: regen_backend=openai: requests in flight at once
    regen_timeout_s: float = ranged(300.0, gt=0, le=86400)  #: regen_backend=openai: seconds one request may take
    #: regen_backend=openai: retries of a request after a connection error, a timeout, HTTP 429 or 5xx (exponential
    #: backoff from 0.5 s); then the run stops, its finished shards kept
    regen_retries: int = ranged(4, ge=0, le=20)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


@dataclass
class OptimConfig:
    lr: float = ranged(6e-4, gt=0)  #: AdamW peak learning rate (DeepSpec 6e-4)
    weight_decay: float = ranged(0.0, ge=0)  #: AdamW weight decay
    beta1: float = ranged(0.9, ge=0, lt=1)  #: AdamW β1
    beta2: float = ranged(0.999, ge=0, lt=1)  #: AdamW β2
    warmup_fraction: float = ranged(0.04, ge=0, le=1)  #: share of the steps in linear warm-up before the cosine decay
    grad_clip: float = ranged(1.0, ge=0, note="0 = no clipping")  #: gradient-norm clip (0 = none)
    epochs: int = ranged(10, ge=1)  #: passes over the training sequences (paper 10)
    max_steps: int = ranged(-1, ge=1, sentinels=(-1,), note="-1 = epochs decide")  #: -1 = epochs decide
    accumulate_grad_batches: int = ranged(1, ge=1)  #: micro-batches per optimiser step


@dataclass
class TrainerConfig:
    accelerator: str = "auto"  #: auto | cpu | gpu (Lightning)
    devices: int = ranged(1, ge=1)  #: devices per node (data-parallel ranks with strategy=ddp)
    strategy: str = "auto"  #: ddp | fsdp | auto ...; see README "Scaling out"
    num_nodes: int = ranged(1, ge=1)  #: machines (multi-node under torchrun / SLURM)
    precision: str = (
        "auto"  #: auto = bf16-mixed on AMX/AVX512-BF16 CPUs / bf16 GPUs, else 32-true; or any Lightning value
    )
    log_every_n_steps: int = ranged(10, ge=1)  #: train/* logging and progress-bar period
    val_check_interval: float = ranged(1.0, gt=0, le=1)  #: validate every this fraction of an epoch
    #: a checkpoint every this many minutes of training inside an epoch (besides every epoch end; 0 = epoch ends
    #: only): a killed run resumes from it, mid-epoch, with the same batches to come. How results are kept, not what
    #: they are: outside sweep hashes and training keys
    checkpoint_every_min: float = ranged(10.0, ge=0, note="0 = checkpoints at epoch ends only")


@dataclass
class TreeConfig:
    """Draft trees (METHOD §5.1): what a round drafts and how the target's one forward over it is accepted."""

    #: chain (one path; decode.policy chooses ℓ) | widths (nodes per depth: the best path scores among the previous
    #: depth's children) | branching (children per node at each depth; drawn without replacement at T > 0) | dynamic
    #: (the best decode.tree.nodes path scores of a beam, N sized per round on this machine's SPS(B) table)
    shape: str = "chain"
    #: shape=widths: nodes at depth 1, 2, ...
    widths: list[int] = ranged(factory=lambda: [4, 2, 2, 1, 1, 1, 1], ge=1)
    #: shape=branching: children per node
    branching: list[int] = ranged(factory=lambda: [2, 2, 1, 1, 1, 1, 1], ge=1)
    #: shape=dynamic: the most nodes a round verifies (N ≤ nodes, chosen per round)
    nodes: int = ranged(16, ge=1, le=MAX_TREE_NODES)
    beam: int = ranged(4, ge=1, le=MAX_TREE_NODES)  #: shape=dynamic: nodes kept (and expanded) per depth
    #: shape=dynamic: deepest level drafted (0 = the drafter's γ)
    depth: int = ranged(0, ge=0, le=MAX_BLOCK, note="0 = the drafter's γ")
    #: descent (sample p_t at each node, descend when the token is a child: exact for any tree, deterministic top-k
    #: children) | rrsw (children drawn from the draft distribution at T > 0 — every child with branching, the first
    #: of each expanded node with widths / dynamic — accepted by rejection sampling without replacement, then descent
    #: on the residual over the other children: at least a chain's acceptance at every node)
    scheme: str = "descent"


@dataclass
class DecodeConfig:
    #: fixed | mtp1 | static | threshold (raw c_k) | calibrated_threshold (c̃_k) | scheduler | async (METHOD §6)
    policy: str = "fixed"
    threshold: float = ranged(0.5, ge=0, le=1)  #: θ of threshold / calibrated_threshold
    static_k: int = ranged(2, ge=1)  #: drafts verified per round by decode.policy=static (mtp1 is 1)
    #: evaluation prompts (taken in turn from decode.eval_sets) on which decode.policy=scheduler is timed against
    #: target-only decoding for the run's speed-up line, when decode.baseline and decode.policy is not scheduler
    #: itself; 0 = skip (τ under decode.policy is measured on every prompt either way)
    speed_prompts: int = ranged(6, ge=0, note="0 = skip the speed-up line")
    #: what scheduler / async price a round with: profile = the SPS(B) table profiled at the start (decisions
    #: reproduce from a seed) | measured = re-priced after every round from the rounds' own verify time per B and
    #: their drafting cost (dspark.scheduling.measured; follows the machine's real costs, timing-dependent ℓ)
    step_costs: str = "profile"
    #: the drafter's parallel stage: auto (bf16 on AMX/AVX512-BF16 CPUs, else fp32) | fp32 | bf16 | int8 (dynamic
    #: int8 linear layers, CPU only: ~2-5x cheaper products where fp32 reads DRAM); decode.* and serve.* alike
    drafter_precision: str = "auto"
    temperature: float = ranged(1.0, ge=0, note="0 = greedy")  #: 0 = greedy verification
    max_new_tokens: int = ranged(128, ge=1)  #: tokens decoded per evaluation prompt
    eval_sets: list[str] = field(default_factory=lambda: ["gsm8k", "humaneval", "mt-bench"])  #: one per domain
    prompts_per_set: int = ranged(4, ge=1)  #: evaluation prompts per set
    calibrate: bool = True  #: fit STS on the calibration split before threshold/scheduler decoding
    #: where the confidence policies' c_k come from (dspark.decoding.confidence): head = the trained confidence head
    #: (dspark only; the paper) | draft_max_prob = the drafter's own top probability per slot (any drafter) | online
    #: = a logistic model on logit(max q_k) and the slot, fitted during decoding from accept/reject outcomes
    confidence: str = "head"
    online_lr: float = ranged(0.05, gt=0, le=10)  #: decode.confidence=online: the step size of its per-round update
    online_l2: float = ranged(1e-3, ge=0, le=1)  #: decode.confidence=online: the per-step pull towards max q
    #: the prompts STS is fitted and scored on: "" = the held-out calibration split of the regenerated training data
    #: (topped up with unseen synthetic prompts) | a prompt set name, e.g. alpaca (the paper's Fig. 6 set); either
    #: way decode.prompts_per_set × len(decode.eval_sets) prompts, half to fit and half to score
    calibration_set: str = ""
    #: also decode every prompt target-only, for the speed-up; false = τ and acceptance only (the lossless output is
    #: the target's either way), which the reference sweeps use: it saves a third of their evaluation time
    baseline: bool = True
    #: how drafts are accepted (dspark.decoding.verify): token = token-by-token rejection sampling (METHOD §5) | block
    #: = block verification (Sun et al. 2024): the block jointly, lossless and never fewer accepted drafts in
    #: expectation; every p_t row is formed. decode.tree.* keep their own schemes (block needs decode.tree.shape=chain)
    verifier: str = "token"
    #: where decode.policy=scheduler stops admitting slots: first_non_improvement = Algorithm 1 (lossless) |
    #: global_argmax = the argmax of Θ over the whole staircase (TensorRT-LLM's variant): NOT lossless (paper
    #: Appendix A: P(A) 0.85 instead of 0.7, tests/test_scheduler.py), allowed for study and flagged "lossy" in the
    #: run's headline, report and metrics (eval/lossy = 1); it drafts every slot (no early drafting stop)
    scheduler_stop: str = "first_non_improvement"
    #: per round, "does drafting pay" (single-request engine): off | cost = before drafting, compare the expected
    #: tokens per second of a drafting round (an EMA of observed τ over its measured seconds) with a plain target
    #: step, and take the plain step (no drafting, ℓ = 0) when drafting does not pay. Lossless (a target step);
    #: chains only (decode.tree.shape=chain)
    bypass: str = "off"
    tree: TreeConfig = field(default_factory=TreeConfig)  #: draft trees instead of chains (decode.tree.shape)


@dataclass
class ServeConfig:
    """Serving under load (`stage=serve`, `sweep=serving`; METHOD §6–§7, paper §5.2, §7)."""

    policy: str = "scheduler"  #: the decode.policy names (one family): mtp1 | static | fixed | threshold | ...
    concurrency: int = ranged(4, ge=1)  #: R, requests kept active at once (closed loop, continuous batching)
    static_k: int = ranged(2, ge=1)  #: drafts verified per request by serve.policy=static (mtp1 is 1)
    #: serve.policy=threshold: prefix before the first raw c_k < θ (calibrated_threshold: c̃_k)
    threshold: float = ranged(0.5, ge=0, le=1)
    num_requests: int = ranged(16, ge=1)  #: requests served per run (round-robin over prompt_sets)
    max_new_tokens: int = ranged(64, ge=1)  #: tokens per request
    prompt_sets: list[str] = field(default_factory=lambda: ["gsm8k", "humaneval", "mt-bench"])  #: the prompt mix
    trace_concurrency: int = ranged(4, ge=1)  #: concurrency of the policy=fixed run whose rounds the simulator replays
    #: simulated R levels
    simulate_concurrency: list[int] = ranged(factory=lambda: [8, 16, 32, 64], ge=1, note="[] simulates nothing")
    sps_table: str = ""  #: SPS(B) JSON for the simulator (e.g. profiled on a GPU); "" = this machine's batched SPS
    #: the target's dtype while serving (float32 | bfloat16 | float16); "" = target_options.dtype. Serving only: the
    #: drafter, its data and its calibration keep target_options.dtype, so a bf16 serve reuses an fp32-trained drafter
    target_dtype: str = ""
    #: what the SPS-planning policies (scheduler, async) price per step: none = the verify forward alone (SPS(B), the
    #: paper's Algorithm 1) | measured = the verify forward plus this engine's measured drafting and per-row work
    #: per step (an EMA; on this CPU ~5.5 ms per row besides the forward). The simulator plans on SPS(B) either way
    step_overhead: str = "none"
    #: how serve.policy=scheduler prices a plan: columns = whole columns at B = R·(k + 1), what the BatchedEngine's
    #: right-padded verify forward really costs (scheduling.scheduler.plan_columns; at or above the best static policy
    #: at every R in results/serving/) | tokens = the paper's Algorithm 1, one candidate at a time at B = Σ_r (1 + ℓ_r)
    #: tokens (for an engine that packs tokens). Composes with step_overhead; the simulator plans with it too. Equal
    #: at R = 1; other policies ignore it
    scheduler_cost: str = "columns"
    #: which verify forward the SPS(B) table times: plain = a forward on a plain cache (the single-request engine's;
    #: keeps reports/serving*.md reproducible) | engine = the BatchedEngine's own (2-D mask over a cache with hole
    #: columns, per-token positions). Equal within 7% on the Zen 3 (benchmarks/results/sps-forward-zen3.md). The
    #: planning policies and the simulator read it
    sps_forward: str = "plain"
    #: where serve.policy's c_k come from: head | draft_max_prob | online (as decode.confidence; online uses
    #: decode.online_lr / decode.online_l2 and learns across the served requests)
    confidence: str = "head"
    #: token | block: how the real engine accepts each row's drafts (as decode.verifier). The simulator replays a
    #: token-verified trace (A at ℓ < γ is min(A_all, ℓ) only under token verification)
    verifier: str = "token"
    #: serve.policy=scheduler's stop in the real engine: first_non_improvement (lossless) | global_argmax (lossy; as
    #: decode.scheduler_stop, flagged serve/lossy = 1). The simulated levels keep Algorithm 1's stop
    scheduler_stop: str = "first_non_improvement"


@dataclass
class TrackingConfig:
    uri: str = ""  #: "" = sqlite under paths.root; or http://HOST:PORT of a running mlflow server
    experiment: str = "dspark-lab"  #: the MLflow experiment every run and sweep logs to
    #: a grid sweep records its finished cells in <paths.root>/ledgers/<experiment>/<sweep>-<hash>.json and imports
    #: those its store lacks from there and from the committed results/<sweep>/ledger.json of the same identity, so it
    #: resumes on another checkout or machine (dspark.tracking.ledger); false: neither
    sweep_ledger: bool = True
    #: log CPU and memory use (MLflow system metrics, system/* every 10 s and at the run's end) with every run
    system_metrics: bool = True


@dataclass
class OptunaConfig:
    """Optuna searches (`sweep=loss_weights`, `sweep=rank`); see dspark.sweeps.optuna_search."""

    storage: str = ""  #: "" = sqlite under paths.root; a journal file path or postgresql:// URL to share a study
    n_trials: int = ranged(8, ge=1)  #: total trials of the study, counted across every worker sharing it
    study: str = ""  #: "" = <sweep name>-<hash of the fixed config>
    #: random trials before TPE models the history (TPE's own default, 10, exceeds small budgets)
    startup_trials: int = ranged(4, ge=0)
    prune: bool = True  #: stop unpromising trials early on the sweep's validation metric (median rule)


@dataclass
class ExportConfig:
    """stage=export: write a trained drafter in another tool's layout (docs/INTEROP.md)."""

    run_dir: str = ""  #: a run directory with drafter.pt; "" = the run this config trains
    layout: str = "deepspec"  #: deepspec (DeepSpec / vLLM Qwen3DSparkModel) | speculators (dspark, dflash, eagle3)
    out_dir: str = ""  #: where config.json + model.safetensors go; "" = <run_dir>/export-<layout>
    dtype: str = "float32"  #: float32 (bit-exact round trip) | bfloat16 | float16


@dataclass
class RunConfig:
    target: str = "smollm2-135m"  #: built-in name (smollm2-135m, tiny), hub id or local path
    drafter: str = "dspark"  #: dspark | dflash | eagle3
    #: drives initialisation, anchors, decoding and (unless data.seed) the data
    seed: int = ranged(0, ge=0, le=SEED_MAX)
    budget: str = "cpu"  #: smoke | cpu | cpu-ref | cpu-long | paper (experiments/budgets/*.yaml)
    stage: str = "all"  #: prepare | train | eval | all | report | profile | serve | export
    sweep: str = ""  #: sweeps/<name>.yaml; set on the command line as sweep=NAME
    #: a label that enters the sweep's hash and nothing else: the same sweep under a new tag starts a fresh parent
    #: run instead of resuming the old one (re-measure a timing sweep such as serving after a code change; give the
    #: same tag to stage=report). "" = no tag, the hash of a sweep run without one
    sweep_tag: str = ""
    paths: PathsConfig = field(default_factory=PathsConfig)
    target_options: TargetConfig = field(default_factory=TargetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    optuna: OptunaConfig = field(default_factory=OptunaConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    @property
    def data_seed(self) -> int:
        """The seed of the training data (`data.seed`, else `seed`)."""
        return self.seed if self.data.seed is None else self.data.seed
