"""The structured config schema: types and defaults of every key rltk reads.

Load order (later wins): this schema < the algorithm preset named by
``algorithm.name`` < YAML file(s) < command-line ``key=value`` overrides.

Components are chosen by name and their arguments sit beside them under the
same key with ``_args`` appended, everywhere::

    algorithm.advantage_fn: rloo
    algorithm.advantage_fn_args: {eps: 1.0e-6}

For keys that take a list of components (``reward.reward_fn``,
``logging.logger``) the ``_args`` entry maps each name to its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class TinyMoeConfig:
    """``model.tiny.moe``: make the tiny model a mixture of experts (Qwen3-MoE; :func:`rltk.models.tiny.build_tiny_moe_model`)."""

    num_experts: int = 0  # experts per layer; 0 keeps the dense Qwen2, e.g. 8 for the tiny MoE default
    top_k: int = 2  # experts each token is routed to
    expert_size: int = 64  # width of each expert's MLP (moe_intermediate_size)


@dataclass
class TinyVisionConfig:
    """``model.tiny.vision``: make the tiny model a vision-language model (Qwen2.5-VL; :func:`rltk.models.tiny.build_tiny_vlm`)."""

    depth: int = 0  # vision-tower blocks; 0 keeps a text-only model, e.g. 2 for the tiny VLM default
    hidden_size: int = 32  # the vision tower's width
    num_heads: int = 2  # its attention heads
    image_size: int = 56  # every image is resized to this square (a multiple of 28): (56/28)^2 = 4 tokens


@dataclass
class TinyModelConfig:
    """The embedded default policy: a random-init Qwen2 built locally (a Qwen3-MoE with ``moe.num_experts``)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 128
    tie_word_embeddings: bool = True
    # the <|tool|> token and role (multi-turn tool use); off, the vocabulary is the 104 tokens the
    # single-turn default's learning was measured with (a token more redraws the whole random init)
    tool_role: bool = False
    moe: TinyMoeConfig = field(default_factory=TinyMoeConfig)
    vision: TinyVisionConfig = field(default_factory=TinyVisionConfig)


@dataclass
class LoraConfig:
    """``model.lora``: train low-rank adapters (LoRA, through peft) instead of every weight.

    Off while ``r`` is 0/null and ``path`` is null. With LoRA on, the optimizer holds only the
    adapters, checkpoints hold only the adapters and their optimizer state, and the KL reference
    is the same module with its adapters switched off (the base model, no second copy).
    """

    r: Optional[int] = None  # adapter rank; 0 or null: no LoRA (unless `path` is set)
    alpha: float = 16.0  # scaling alpha / r of the adapter's output
    dropout: float = 0.0  # dropout on the adapter's input, in [0, 1)
    target_modules: Any = "all-linear"  # module names (last name part, e.g. [q_proj, v_proj]) or all-linear
    path: Optional[str] = None  # an adapter folder (adapter_config.json) to start from; its r/alpha/targets apply


@dataclass
class ModelConfig:
    """The policy: a local Hugging Face model folder or the embedded tiny model; its dtype, kernel and LoRA."""

    path: Optional[str] = None  # a local HF causal-LM or image-text-to-text folder; null builds the tiny model
    dtype: str = "float32"  # float32 | bfloat16 | float16
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    logprob_impl: str = "auto"  # auto | triton | triton-hopper | torch | naive (rltk/kernels)
    logprob_chunk_size: Optional[int] = None
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    freeze_vision_tower: bool = True  # a VLM's vision tower (and its merger) keeps its weights, as verl and EasyR1 do


@dataclass
class DataConfig:
    """The prompts: a synthetic task (``task``) or a dataset file (``path``), and how each row becomes a prompt."""

    task: Optional[str] = "arithmetic"  # synthetic task used when `path` is null
    task_args: Dict[str, Any] = field(default_factory=dict)
    train_size: int = 2000
    eval_size: int = 200
    path: Optional[str] = None  # json, jsonl, parquet, csv or a local HF datasets folder
    split: Optional[str] = None
    eval_path: Optional[str] = None
    eval_split: Optional[str] = None
    prompt_key: str = "prompt"
    image_key: str = "images"  # column of each row's images (paths, bytes, arrays; rltk/data/images.py), if any
    messages_key: str = "messages"  # column of chat messages (rltk/data/chat.py); a transcript also feeds the warm-up
    answer_key: Optional[str] = "answer"  # null: the rows have no answer (preference data, plain SFT text)
    extras_keys: Optional[List[str]] = None  # columns kept as row extras; null keeps all others
    system_prompt: Optional[str] = None
    use_chat_template: bool = False
    prompt_template: str = "{prompt}"  # plain {prompt} / {<extras column>} fields only (rltk/data/templates.py)
    max_prompt_tokens: int = 64
    on_too_long: str = "filter"  # filter | error
    shuffle: bool = True


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction``: correct for rollout log-probs that differ from the trainer's.

    Each mode is off with null; see :mod:`rltk.algorithms.mismatch` for the formulas and papers.
    ``tis`` and ``mis`` both set the importance weight (at most one); ``rejection`` drops whole
    responses and combines with either. Needs ``algorithm.use_rollout_logprobs=false``.
    """

    tis: Optional[str] = None  # token | sequence: weight min(rho, tis_cap), rho = pi_old / pi_rollout
    tis_cap: Optional[float] = 2.0  # null: no truncation (plain importance weight)
    mis: Optional[str] = None  # token | sequence: weight rho inside [mis_low, mis_high], drop outside
    mis_low: float = 0.5  # 0: no lower bound
    mis_high: float = 2.0
    rejection: Optional[str] = None  # geometric | sequence | token: drop responses whose ratio leaves the band
    rejection_low: float = 0.5  # geometric means sit near 1: a band like [0.99, 1.01] is typical there
    rejection_high: float = 2.0
    log_metrics: bool = False  # log mismatch/* metrics even with every mode off


@dataclass
class AlgorithmConfig:
    """The RL algorithm: a preset (``name``) and the advantage, policy loss, loss and KL components it sets."""

    name: str = "grpo"  # an algorithm preset; it fills the defaults of this section
    advantage_fn: str = "grpo"
    advantage_fn_args: Dict[str, Any] = field(default_factory=dict)
    policy_loss: str = "ppo_clip"
    policy_loss_args: Dict[str, Any] = field(default_factory=dict)
    loss_agg: str = "token-mean"
    loss_agg_args: Dict[str, Any] = field(default_factory=dict)
    kl_penalty_fn: str = "k3"
    kl_penalty_fn_args: Dict[str, Any] = field(default_factory=dict)
    kl_coef: float = 0.0  # 0 skips the reference model entirely
    kl_in: str = "loss"  # loss | reward
    kl_controller: str = "fixed"  # fixed | adaptive
    kl_target: float = 0.1  # adaptive controller only
    kl_horizon: int = 10000  # adaptive controller only
    entropy_coef: float = 0.0
    use_rollout_logprobs: bool = False  # old log-probs from the engine instead of a trainer recompute
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # DAPO's dynamic sampling: train only on groups whose scores differ, drawing more prompts until
    # trainer.prompts_per_step such groups are in hand or dynamic_sampling_max_rounds rounds of
    # generation have run (the step then trains on what it has; the metrics count it).
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 8
    # Mixture-of-experts policies (rltk.models.moe, docs/tutorials/moe.md). routing_replay: none | rollout (alias r3,
    # verl's router_replay.mode R3, Megatron/SkyRL's moe_enable_routing_replay): every training-side forward
    # routes each token to the experts the rollout engine used (the batch's routed_experts)
    routing_replay: str = "none"
    # Switch load-balancing loss added to the policy loss with this weight (MoE policies; 0: off)
    router_aux_loss_coef: float = 0.0


@dataclass
class RolloutConfig:
    """Generation: the engine that samples responses, the workflow that runs an episode, and the sampling settings."""

    engine: str = "hf"
    engine_args: Dict[str, Any] = field(default_factory=dict)
    workflow: str = "single_turn"
    workflow_args: Dict[str, Any] = field(default_factory=dict)
    n: int = 8  # samples per prompt (the group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 8
    eval_max_new_tokens: Optional[int] = None  # defaults to max_new_tokens


@dataclass
class EnvConfig:
    """``env``: the environment and tools of multi-turn episodes (``rollout.workflow: multi_turn``).

    Other workflows ignore it (``agentic`` reads the limits where they apply).
    Each name is a registered component (``rltk list environment|tool|tool_parser``).
    """

    environment: Optional[str] = None  # a registered environment, or null (tools only)
    environment_args: Dict[str, Any] = field(default_factory=dict)
    # registered tools, or `<server>.<tool>` / `<server>.*` of env.mcp_servers; rendered through the template's tools=
    tools: List[str] = field(default_factory=list)
    tools_args: Dict[str, Any] = field(default_factory=dict)  # {tool_name: {arg: value}}
    # MCP servers whose tools env.tools may name: {name: {command: [argv] | url: ..., env, cwd, timeout_s,
    # connect_timeout_s}} (rltk.tools.mcp)
    mcp_servers: Dict[str, Any] = field(default_factory=dict)
    tool_parser: str = "hermes"
    tool_parser_args: Dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4  # assistant turns per episode
    max_new_tokens_per_turn: int = "${rollout.max_new_tokens}"  # type: ignore[assignment]
    max_total_tokens: int = 256  # response budget over all turns (assistant + observation tokens); over it: truncated


@dataclass
class RewardConfig:
    """Scoring: the reward functions, their weights, and what a failing or slow one gives."""

    reward_fn: List[str] = field(default_factory=lambda: ["exact_match"])
    reward_fn_args: Dict[str, Any] = field(default_factory=dict)  # {name: {arg: value}}
    weights: Dict[str, float] = field(default_factory=dict)  # {name: weight}, default 1.0
    fallback: float = 0.0  # reward given when a reward function raises or times out
    # Longest one call of a reward function not marked bounded may run, in a worker process that is
    # killed on timeout; null runs every reward in-process with no timeout (for rewards you trust).
    timeout_s: Optional[float] = 5.0
    workers: int = 4  # worker processes for reward functions not marked bounded (builtins run in-process)
    # (reward_model and llm_judge are batched: in-process, one call per step, under their own timeout_s)


@dataclass
class ExpertDataConfig:
    """Expert responses (demonstrations, a stronger model's solutions) put in the buffer for a
    strategy that mixes them in (``buffer.sample_strategy=mix_expert``)."""

    path: Optional[str] = None  # json, jsonl, parquet, csv or a datasets folder; null: no expert data
    split: Optional[str] = None
    prompt_key: str = "prompt"  # formatted like the training prompts (data.prompt_template, chat template ...)
    response_key: str = "response"
    answer_key: Optional[str] = "answer"  # ground truth the reward scores the response against; null: none
    score: Optional[float] = None  # a fixed score for every expert response instead of the reward's
    source: str = "expert"  # the buffer source they are put under (mix_expert's expert_source)


@dataclass
class BufferConfig:
    """What each step trains on: the sampling strategy, expert data, and the queue of asynchronous training."""

    sample_strategy: str = "on_policy"
    sample_strategy_args: Dict[str, Any] = field(default_factory=dict)
    expert: ExpertDataConfig = field(default_factory=ExpertDataConfig)
    # The persistent experience queue of asynchronous training (rltk.training.rollouts.asynchronous.queue, SQLite): producers write
    # experiences tagged with their policy version, the trainer takes them. null: a file in the run folder.
    queue_path: Optional[str] = None
    queue_timeout_s: float = 600.0  # the longest any wait lasts: trainer for experiences, producer for weights
    # SQLite journal of the queue: wal (trainer and producers on one machine) | delete (producers on other
    # machines writing it through a network file system, where WAL's shared memory does not reach)
    queue_journal: str = "wal"
    # What a resumed asynchronous stage does with its queue. keep: train on from it, after checking it holds
    # what the checkpoint trained from it (a queue deleted, emptied, damaged or replaced is refused, exit 2).
    # fresh: a new queue (the old file renamed to <name>.discarded); what the old one held untrained is lost
    # and sampled anew, and the producers go on after the last experiences the checkpoint trained, so none is
    # trained twice. Give it for the resume that needs it; it changes nothing for a stage that starts afresh.
    queue_resume: str = "keep"


@dataclass
class TrainerConfig:
    """The RL stage's optimisation: steps, batch sizes, learning rate and schedule, evaluation."""

    total_steps: int = 200  # optimizer steps of the RL stage
    prompts_per_step: int = 8  # rollout batch: prompts per step (x rollout.n responses)
    mini_batches: int = 1  # optimizer steps per rollout batch and epoch
    ppo_epochs: int = 1
    micro_batch_size: int = 32  # sequences per forward/backward
    # micro-batches by a token budget instead (rows sorted by length, same count on every rank); null = by
    # micro_batch_size. Counts computed tokens: rows x (longest prompt + response), or the sum when packed
    max_tokens_per_micro_batch: Optional[int] = None
    pack_sequences: bool = False  # run each micro-batch's real tokens packed into one row (no padding)
    lr: float = 5.0e-5
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | linear | cosine
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_size: Optional[int] = None  # held-out rows per evaluation; null = all
    # The sampled evaluation (eval/sampled_accuracy) draws its samples from the run's random stream, so two
    # evaluations of the same weights differ by sampling noise, and evaluating changes later training draws.
    # An integer seeds every sampled evaluation on its own stream (the run's stream left as it was): the
    # same weights then give the same number. Greedy evaluation (eval/accuracy) never depends on it.
    eval_seed: Optional[int] = None
    # Asynchronous RL (docs/tutorials/async.md; GRPO recipe). mode: sync (sample, score, update,
    # repeat) | one_step_off (a producer process samples step t+1's batch with policy t-1 while step t
    # trains: max_staleness 1) | async (the producer runs ahead by at most max_staleness policy versions;
    # pair it with algorithm.policy_loss=decoupled_ppo to weigh stale tokens). Versions count RL steps.
    mode: str = "sync"
    max_staleness: int = 1  # async: the oldest policy version a trained token may come from, counted back
    stale_policy: str = "drop"  # drop (counted in staleness/dropped) | wait (for fresher data, buffer.queue_timeout_s)
    sync_every: int = 1  # RL steps between weight syncs to the producer; at most max_staleness + 1
    # Local producer processes (one_step_off / async). Each samples its own share of the prompts
    # (train rows k, k + N, ...); one that keeps dying is reported and training goes on with the others.
    # 0: none; producers started by your own launcher, on any machine sharing the run folder, run
    # `rltk produce RUN_DIR` (docs/tutorials/async.md, "Several machines").
    producers: int = 1


@dataclass
class SFTConfig:
    """The supervised warm-up stage (``type: sft`` in ``stages``)."""

    steps: int = 300  # the most steps; fewer when stop_at_accuracy is reached first
    batch_size: int = 32
    lr: float = 1.0e-3
    warmup_steps: int = 20
    lr_schedule: str = "cosine"
    # End the warm-up once accuracy on `probe_size` training prompts reaches this, checked
    # every `probe_every` steps (null: run all `steps`). RL then starts from the same skill level
    # whatever the seed or CPU, instead of wherever a fixed step count happens to land.
    stop_at_accuracy: Optional[float] = None
    # greedy: one greedy answer per probe prompt. sampled: one answer at rollout.temperature, seeded by
    # trainer.eval_seed -- the accuracy GRPO's groups see, so RL starts where its groups hold successes
    # (a greedy probe can pass while sampled answers still almost never succeed).
    probe: str = "greedy"
    probe_every: int = 100
    probe_size: int = 200
    completion_key: Optional[str] = None  # file datasets: column with the target; default the answer
    # Steps between held-out evaluations during the stage (and one before its first step); null: none, as in
    # a warm-up before RL. `rltk run sft` sets it: there the stage is the whole run.
    eval_every: Optional[int] = None


@dataclass
class RewardModelTrainingConfig:
    """Reward-model training (``rltk run reward_model``): a Bradley-Terry model from preference pairs.

    The model is ``model.path``'s (or the tiny model's) architecture and backbone with a one-output
    score head; its folder (``<run>/reward_model``) is what ``reward.reward_fn_args.reward_model.path``
    loads. Micro-batching, weight decay, betas and clipping come from ``trainer``.
    """

    loss: str = "bradley_terry"  # a registered reward_model_loss
    loss_args: Dict[str, Any] = field(default_factory=dict)
    chosen_key: str = "chosen"  # data.path: the column of the preferred response (text)
    rejected_key: str = "rejected"  # data.path: the column of the dispreferred response (text)
    wrong_offset: int = 20  # synthetic task: the rejected answer is the right one moved by +-1..this
    # synthetic task: this fraction of rejected answers is instead the right one with a digit dropped or added
    # (an answer of the wrong length, which a policy trained against the model otherwise learns to give)
    wrong_length: float = 0.0
    steps: int = 300
    batch_size: int = 32  # pairs per optimizer step
    lr: float = 1.0e-3
    warmup_steps: int = 20
    lr_schedule: str = "cosine"
    max_length: int = 1024  # tokens of prompt + response the model reads (cut from the left, as the reward fn does)
    eval_every: int = 100  # steps between held-out pairwise accuracies (and one before the first step)


@dataclass
class DPOConfig:
    """The preference stage of the ``dpo`` recipe (``type: dpo`` in ``stages``): DPO and its variants.

    Steps, learning rate and schedule come from ``trainer`` (``total_steps``, ``lr`` ...); each step
    trains on ``trainer.prompts_per_step`` pairs.
    """

    loss: str = "sigmoid"  # a preference_loss: sigmoid (DPO, cDPO with label_smoothing) | ipo | hinge
    loss_args: Dict[str, Any] = field(default_factory=dict)
    beta: float = 0.1  # strength of the implicit KL to the reference
    # + nll_coef x the chosen responses' token-mean NLL (RPO / iterative RPO, Pang et al. 2024; TRL's rpo_alpha)
    nll_coef: float = 0.0
    # Columns of a data.path dataset holding the preferred and the dispreferred response: text, or chat
    # messages (the assistant turns after the prompt). Without data.path, the synthetic task's pairs
    # (rltk.data.preferences) fill them: its answer chosen, a near miss rejected.
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    # The reference's log-probs of every pair computed once when the stage starts (then the frozen copy is
    # dropped): one forward over the data instead of one per step. Offline only.
    precompute_reference: bool = False
    # Online DPO: each step samples rollout.n responses per prompt from the current policy, scores them
    # with reward.reward_fn and trains on the best and the worst of each group whose scores differ.
    online: bool = False


@dataclass
class DistillConfig:
    """The teacher of the ``distill`` recipe (``type: distill`` in ``stages``): on-policy distillation.

    The student is ``model.path`` (or the tiny model); steps, learning rate, sampling and the policy
    loss come from ``trainer``, ``rollout`` and ``algorithm`` as in GRPO, with
    ``algorithm.advantage_fn: on_policy_distill`` (its ``algorithm.advantage_fn_args.task_coef`` mixes in
    the task reward's group advantage).
    """

    # A Hugging Face causal-LM folder, or an rltk checkpoint (a step_XXXXXX folder of full weights; its
    # run's tokenizer is read from <output_dir>/tokenizer). Its tokenizer must be the student's.
    teacher_path: Optional[str] = None
    teacher_dtype: str = "float32"


@dataclass
class CriticConfig:
    """The value model of recipes with a critic (``ppo``); other recipes ignore this section.

    The critic has its own optimizer, so there is no value-loss coefficient: with
    Adam, scaling a loss that no other loss shares its parameters with changes
    almost nothing. Micro-batching, weight decay, betas, gradient clipping and the
    LR schedule's shape come from ``trainer``.
    """

    model_path: Optional[str] = None  # a critic folder or an HF causal-LM folder; null copies the policy's backbone
    lr: float = 1.0e-4
    lr_warmup_steps: int = 0  # LR warm-up of the critic, in RL steps
    warmup_steps: int = 0  # first RL steps that train only the critic (the policy waits for a useful baseline)
    value_clip: Optional[float] = 0.2  # PPO value clipping in reward units; null = plain squared error
    head_init_std: float = 0.0  # std of the value head's initial weight; 0 = zero init (V = 0 before training)


@dataclass
class CheckpointConfig:
    """Checkpoints: how often, how many are kept, and what a run resumes or starts from."""

    every: int = 100  # steps between checkpoints, plus each stage's last step; 0 writes none, not even the last
    keep_last: int = 2
    resume: str = "auto"  # auto | never | a checkpoint folder
    # A stage's last checkpoint of another run (its step_XXXXXX folder, kept whatever keep_last): a new run
    # starts after that stage, from its weights, and trains the stages after it (see rltk/training/scaffold/resume.py).
    start_from: str | None = None


@dataclass
class GuardConfig:
    """The divergence guard (rltk/training/scaffold/guard.py): stops a run that has stopped learning, exit status 3.

    Entropy bounds are fractions of log(V), V the LM head's size: 1.0 is the
    uniform distribution, 0 a single token. The defaults sit far from a
    healthy run: the tiny default's policy keeps 0.09-0.15 of log(V) in RL
    (measured over its 200 GRPO and PPO steps). The guard reads metrics each
    step computes anyway; only the weights check reads the parameters again.
    """

    enabled: bool = True
    # Steps in a row that trained nothing (every optimizer step skipped for a non-finite gradient
    # norm, or a non-finite loss) before the run stops; 0 = never. A stage that ends without a
    # single update applied stops the run too, however short it is.
    max_skipped_steps: int = 10
    # Mean token entropy below this x log(V): collapsed onto single tokens; 0 = off. The entropy is the
    # sampling distribution's, at rollout.temperature: lower this for temperatures well below 1.
    entropy_min: float = 1.0e-4
    # Above this x log(V): collapsed to uniform. Counts only once the stage's entropy has been below
    # it (a randomly initialised model starts at uniform); 1 = off.
    entropy_max: float = 0.999
    entropy_patience: int = 5  # steps in a row outside [entropy_min, entropy_max] before the run stops
    # Steps between nan/inf checks of the weights; they are also checked before every checkpoint, so
    # none holds such weights. 0 = only before checkpoints.
    check_weights_every: int = 10


@dataclass
class LoggingConfig:
    """Logging: the loggers, the curves PNG, and the rollout traces the dashboard reads."""

    logger: List[str] = field(default_factory=lambda: ["console", "jsonl"])
    logger_args: Dict[str, Any] = field(default_factory=dict)  # {name: {arg: value}}
    plot: bool = True  # a PNG of reward and held-out accuracy in the run folder at the end
    # Rollout traces (traces.jsonl, rltk/training/scaffold/traces.py): a sample of each RL step's trajectories with
    # prompt, response, rewards, advantages and per-token masks, for `rltk dashboard` or jq. On by default:
    # the samples of a step cannot be had back once the run is over, and the cap bounds what they cost.
    traces: bool = True
    traces_per_step: int = 16  # trajectories kept per traced step, as whole groups (at least one group's start)
    traces_every: int = 1  # trace every N-th RL step
    traces_max_mb: float = 100.0  # the file's size cap; later steps are not traced once it is reached


@dataclass
class StageConfig:
    """One stage of a run: its name, its type, and the keys it overrides."""

    name: str = "rl"
    # a registered stage (`rltk list stage`: sft, dpo, grpo, ppo, distill, a plugin's), wherever the config runs,
    # or rl (the RL loop of the recipe run: grpo's, ppo's or distill's)
    type: str = "rl"
    overrides: Dict[str, Any] = field(default_factory=dict)  # {dotted.key: value} for this stage


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 0
    output_dir: str = "runs/${name}"
    device: str = "auto"  # auto | cpu | cuda
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    strategy: str = "accelerate"
    strategy_args: Dict[str, Any] = field(default_factory=dict)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # Where an asynchronous stage's producers run: local (processes beside the trainer, sharing its run folder)
    # | ray (Ray actors on the nodes of a Ray cluster; experiences and weights over the network, no shared
    # folder: docs "Several machines on Ray"). launcher_args (ray): address (auto | host:port | empty: start a
    # local Ray), namespace, connect_timeout_s, placement_timeout_s, max_restarts, work_dir,
    # producer: {cpus, gpus, resources: {name: amount}, labels: {key: value}},
    # rewards: {<reward_fn name>: {cpus, gpus, resources, labels, replicas, timeout_s}} (reward services)
    launcher: str = "local"
    launcher_args: Dict[str, Any] = field(default_factory=dict)
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelTrainingConfig = field(default_factory=RewardModelTrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    # the stages the run trains, in order: [{name, type, overrides}]; each recipe's config sets its own
    stages: List[StageConfig] = field(default_factory=lambda: [StageConfig()])


# Config keys that name registered components: key -> (registry kind, takes a list).
COMPONENT_KEYS: dict[str, tuple[str, bool]] = {
    "algorithm.name": ("algorithm", False),
    "algorithm.advantage_fn": ("advantage_fn", False),
    "algorithm.policy_loss": ("policy_loss", False),
    "dpo.loss": ("preference_loss", False),
    "algorithm.loss_agg": ("loss_agg", False),
    "algorithm.kl_penalty_fn": ("kl_penalty_fn", False),
    "reward_model.loss": ("reward_model_loss", False),
    "rollout.engine": ("rollout_engine", False),
    "rollout.workflow": ("workflow", False),
    "reward.reward_fn": ("reward_fn", True),
    "buffer.sample_strategy": ("sample_strategy", False),
    "strategy": ("training_strategy", False),
    "logging.logger": ("logger", True),
}

# Plain keys restricted to a few values.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.logprob_impl": ("auto", "triton", "triton-hopper", "torch", "naive"),
    "data.on_too_long": ("filter", "error"),
    "algorithm.kl_in": ("loss", "reward"),
    "algorithm.kl_controller": ("fixed", "adaptive"),
    "algorithm.routing_replay": ("none", "rollout", "r3"),
    "trainer.lr_schedule": ("constant", "linear", "cosine"),
    "trainer.mode": ("sync", "one_step_off", "async"),
    "launcher": ("local", "ray"),
    "trainer.stale_policy": ("drop", "wait"),
    "buffer.queue_journal": ("wal", "delete"),
    "buffer.queue_resume": ("keep", "fresh"),
    "sft.lr_schedule": ("constant", "linear", "cosine"),
    "sft.probe": ("greedy", "sampled"),
    "reward_model.lr_schedule": ("constant", "linear", "cosine"),
    "device": ("auto", "cpu", "cuda"),
    "distill.teacher_dtype": ("float32", "bfloat16", "float16"),
}

