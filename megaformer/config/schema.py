"""Typed run configuration: one frozen dataclass per YAML section.

Every field has a docstring (the string literal under it) that says its unit and meaning. Loading is
strict (see :mod:`megaformer.config.load`): unknown keys, wrong types and impossible values raise
:class:`ConfigError` naming the key, the value and the fix. This module imports nothing else of the
project, so every layer may depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BUDGET_SKIP_STEPS = 5
"""Steps a compute-budget run takes before timing itself (one-time costs of the first steps:
allocator, kernel selection, loader and cache warm-up; measured on CPU to run up to 20 % slow)."""


TRUST_FLAG = "--trust-checkpoint-code"
"""The tools' switch that unpickles a checkpoint in full (megaformer.checkpoint.safe_load); here, in a
module that imports no torch, so that a tool's ``--help`` can name it without importing torch."""
TRUST_KEY = "train.trust_checkpoint_code"
"""The config key of the same switch for ``train.init_from``."""


class ConfigError(ValueError):
    """A configuration key or value that cannot work; the message names the key and the fix."""


# The values a model's choices may take: the config's validators (megaformer.config.load) and the
# model read them from here.
POSITION_EMBEDDINGS = ("sinusoidal", "learned")
ACTIVATIONS = ("gelu", "relu2")
NORM_SCHEMES = ("pre_ln", "post_ln", "deepnorm")
INITS = ("legacy", "gpt2", "fairseq")
HEAD_SCALE_POSITIONS = ("before_out_proj", "after_out_proj")
# model.objective: the causal LM (the default), or RoBERTa's masked LM (megaformer.data.mlm).
OBJECTIVES = ("clm", "mlm")
# model.mlm_head_positions: where the masked LM's head decodes.
MLM_HEAD_POSITIONS = ("all", "masked")
# model.fused_kernels: Triton kernels for NormFormer's extra LayerNorms (megaformer.model.kernels).
FUSED_KERNELS = ("auto", "on", "off")
# model.attention_backend: the fused kernel of attention with dropout on GPUs (megaformer.parallel.rng_ops).
ATTENTION_BACKENDS = ("auto", "flash", "efficient", "cudnn", "sdpa")
# Switches defined on a Pre-LN layer only: NormFormer's operations and the '+ 3 More LN' ablation
# (paper Sec. 2, Table 4).
PRE_LN_ONLY = ("post_attn_ln", "head_scale", "ffn_ln", "resid_scale", "qkv_ln")
# train.compile: a bool, or this string.
COMPILE_AUTO = "auto"
MLM_VOCAB_SIZE = 50265
"""RoBERTa-base's vocabulary (its embedding rows): 4 specials (``<s> <pad> </s> <unk>``), the 50257
GPT-2 symbols, 3 ``madeupword`` rows that pad fairseq's dictionary to a multiple of 8, ``<mask>``.
Ours uses ids 0..50259 of it; 50260..50264 are never input or target, as RoBERTa's ``<unk>`` and
``madeupword`` rows are never in its byte-level data. Set ``model.vocab_size`` to this. (Defined
here, not in :mod:`megaformer.data.mlm`, which uses it, so that the config checks it without
importing data code.)"""


@dataclass(frozen=True)
class ModelConfig:
    """The decoder LM: NormFormer (Shleifer et al. 2021, arXiv:2110.09456) or its Pre-LN baseline.

    With ``post_attn_ln``, ``head_scale``, ``ffn_ln`` and ``resid_scale`` all False the model is the
    Pre-LN GPT baseline; with the first three True it is NormFormer as in the paper (Fig. 1).
    ``norm_scheme`` selects the paper's other baselines (Post-LN) and DeepNorm; ``qkv_ln`` is the
    Table 4 ablation '+ 3 More LN'.
    """

    vocab_size: int = 50257
    """Tokenizer vocabulary (GPT-2 BPE: 50257, including EOD). The embedding is padded above it."""
    make_vocab_size_divisible_by: int = 128
    """Pad the embedding rows to a multiple of this × tp_size (Megatron's rule); padded rows get no
    probability mass."""
    hidden_size: int = 256
    """Model width d."""
    num_layers: int = 4
    """Number of decoder blocks."""
    num_attention_heads: int = 4
    """Attention heads; hidden_size must be divisible by it."""
    ffn_hidden_size: int = 0
    """FFN intermediate width; 0 means 4 × hidden_size."""
    seq_len: int = 256
    """Context length in tokens (samples hold seq_len + 1 tokens); also the position table size."""
    position_embedding: str = "sinusoidal"
    """'sinusoidal' (the paper, after Shortformer) or 'learned'."""
    activation: str = "gelu"
    """'gelu' or 'relu2' (squared ReLU, the paper's 2.7B run)."""
    post_attn_ln: bool = True
    """NormFormer: LayerNorm on the attention output, after W_O."""
    head_scale: bool = True
    """NormFormer: learned per-head scale g_i (init 1) applied before W_O (after it, as fairseq, with
    head_scale_position='after_out_proj')."""
    ffn_ln: bool = True
    """NormFormer: LayerNorm on the FFN intermediate, after the activation."""
    resid_scale: bool = False
    """NormFormer: learned vector λ_resid (init 1) scaling the FFN residual (paper: below 1.3B)."""
    head_scale_position: str = "before_out_proj"
    """Where HeadScale's γ (one per head) acts. 'before_out_proj' (default, the paper's equation):
    head i's attention output times γ_i, then W_O. 'after_out_proj' (fairseq's code,
    fairseq/modules/transformer_layer.py, c_attn): W_O's output, its bias included, viewed as
    [num_heads, head_dim] channel chunks, chunk i times γ_i; W_O has already mixed the heads, so this is
    a row-wise rescaling of W_O, another function. γ is then replicated across TP ranks (it acts
    after the row-parallel reduce). Needs head_scale (ignored without it)."""
    norm_scheme: str = "pre_ln"
    """Where the LayerNorms sit. 'pre_ln' (default): x + F(LN(x)) per sublayer, a final LayerNorm
    before the output projection (GPT-2); the NormFormer switches above apply to it. 'post_ln':
    LN(x + F(x)) per sublayer (Vaswani et al. 2017; fairseq normalize_before=False), no final
    LayerNorm. 'deepnorm': LN(α·x + F(x)) with α = (2N)^(1/4) and W_V, W_O, W1, W2 initialised with
    std β·init_std, β = (8N)^(-1/4), N = num_layers (Wang et al. 2022, DeepNet, decoder-only), no
    final LayerNorm. post_ln and deepnorm need the four NormFormer switches and qkv_ln off."""
    qkv_ln: bool = False
    """The paper's Table 4 ablation '+ 3 More LN': a LayerNorm on each of the query, key and value
    projections, each over its full hidden_size features (all heads together, before the split into
    heads), gain and shift of size hidden_size each; needs norm_scheme 'pre_ln'."""
    hidden_dropout: float = 0.0
    """Dropout on the attention and FFN outputs (probability)."""
    embedding_dropout: float = 0.0
    """Dropout on the embedding output (token embedding × scale + positions) before the first block
    (probability). fairseq applies its model dropout (--dropout, i.e. hidden_dropout) there
    (transformer_decoder.py forward_embedding: self.dropout_module(x)); 0 (no dropout) keeps runs from
    before this key bitwise. Masks from the 'replicated' dropout stream (the 'sharded' one under
    sequence parallelism), as the hidden dropout."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities (probability)."""
    attention_backend: str = "auto"
    """The fused kernel attention with dropout runs on a GPU (megaformer.parallel.rng_ops), eager and
    compiled alike, so both draw the same masks: 'auto' (default): FlashAttention-2 ('flash') for
    fp16 / bf16 on compute capability 8.0+ with head_dim <= 256 and a multiple of 8, else the
    memory-efficient kernel ('efficient': V100, fp32); 'flash', 'efficient' or 'cudnn' to name one
    (a kernel that cannot run the shape fails at the first step with torch's reason). Compiled, the
    kernel's own backward runs on its saved output, log-sum-exp and Philox seed and offset: one
    attention forward per micro-batch. 'sdpa': torch's own choice (cuDNN on Hopper in torch 2.11),
    and compiled, an operator whose backward reruns the forward (the code before this key; 20-22 %
    of the 125M step on an H200). Without dropout, and on CPUs, SDPA chooses as always."""
    layernorm_eps: float = 1e-5
    """Epsilon of every LayerNorm."""
    fused_kernels: str = "auto"
    """Triton kernels for NormFormer's extra operations (megaformer.model.kernels): FFN_LN fused with
    the activation (forward and backward; under TP the statistics are still reduced across the
    group, exactly as the eager sharded LayerNorm), POSTATTN_LN fused with its dropout and
    residual add, and HeadScale's g folded into W_O's input columns. The same function as the
    eager path (the reference and the fallback) up to rounding; the dropout masks are eager's.
    'auto' (default): on where the block's tensors are on a CUDA device and Triton imports (not on
    fake CUDA), eager elsewhere (the CPU); 'on': always (needs Triton; on a CPU only under Triton's
    interpreter, TRITON_INTERPRET=1, as the tests run it); 'off': the eager operations. Blocks
    without post_attn_ln / ffn_ln have nothing to fuse; under ZeRO-3 (parameters gathered in
    module hooks the kernels bypass) the blocks stay eager."""
    position_offset: int = 0
    """Sinusoidal position index of the first token: token t uses row t + position_offset of a table
    of seq_len + position_offset rows. fairseq numbers positions from padding_idx + 1 = 2
    (utils.make_positions), so a fairseq model needs 2 (megaformer.tools.import_fairseq sets it).
    Sinusoidal positions only (learned positions with an offset are refused)."""
    init: str = "legacy"
    """Which reference's initialisation (NormFormer's own gains and scales, HeadScale γ, ResScale λ,
    every LayerNorm γ = 1 and β = 0, are the same under all three):

    'legacy' (default, what this project did before the key): a MIX of two references. The token
    embedding is fairseq's, N(0, embedding_init_std or d^-0.5) times sqrt(d) (scale_embedding), but
    every matrix is GPT-2's N(0, init_std), W_O and W2 over sqrt(2N) under pre_ln (β·init_std for
    W_V, W_O, W1, W2 under deepnorm; init_std for all under post_ln), biases 0, learned positions and
    an untied output N(0, init_std). The unit-scale token embedding against 0.02-scale sublayers
    leaves the residual stream almost only the input token's own embedding, so the tied output
    predicts the input token: at the 125M shape the loss at init on random tokens is ~22.8 nats
    (ln V = 10.8). Kept as the default so existing runs and checkpoints reproduce bitwise; a new
    run should pick one of the two below.

    'gpt2' (nanoGPT model.py GPT._init_weights and the c_proj loop in GPT.__init__; HF
    modeling_gpt2.py GPT2PreTrainedModel._init_weights): every Linear weight N(0, init_std = 0.02),
    biases 0; the residual projections W_O and W2 N(0, init_std / sqrt(2N)) under pre_ln (under
    post_ln / deepnorm as 'legacy': no depth scaling, β for deepnorm); token embedding and learned
    positions N(0, init_std) (nanoGPT and HF; OpenAI's TF code drew wpe with 0.01); no sqrt(d)
    scale: needs scale_embedding=false (refused otherwise).

    'fairseq' (transformer_lm, the NormFormer paper's code base): token embedding N(0, d^-0.5)
    (fairseq/models/transformer/transformer_base.py Embedding; fairseq zeroes its padding row, the
    GPT-2 vocabulary here has none) times sqrt(d) with scale_embedding; q, k, v weights
    xavier_uniform with gain 1/sqrt(2), per d × d block of the fused qkv, their biases nn.Linear's
    default U(±1/sqrt(d)); W_O xavier_uniform (gain 1), bias 0
    (fairseq/modules/multihead_attention.py MultiheadAttention.reset_parameters); W1 and W2 and
    their biases nn.Linear's default U(±1/sqrt(fan_in)) (fairseq/modules/transformer_layer.py
    TransformerDecoderLayerBase.build_fc1 / build_fc2); learned positions N(0, d^-0.5)
    (fairseq/modules/positional_embedding.py); an untied output N(0, d^-0.5)
    (transformer_decoder.py build_output_projection); no depth scaling; init_std unused. Under
    deepnorm, W_V, W_O, W1, W2 (and the V, W1, W2 biases) are these inits times β = (8N)^(-1/4), as
    torchscale (the DeepNet authors' code) divides its fairseq-style init by (8N)^(1/4). Line numbers
    of each source: tests/unit/test_model_init.py."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weight matrices ('legacy' and 'gpt2' init;
    unused by 'fairseq', whose inits follow from the shapes)."""
    embedding_init_std: float = 0.0
    """Standard deviation of the token (and tied output) embedding init; 0 means the init's own:
    hidden_size^-0.5 under 'legacy' and 'fairseq' (fairseq's choice for the paper's models), init_std
    under 'gpt2'."""
    scale_embedding: bool = True
    """Multiply token embeddings by sqrt(hidden_size) before adding positions (Vaswani et al. 2017,
    Sec. 3.4; fairseq's default). With the unit-scale sinusoidal table and a small init, unscaled
    token embeddings are drowned by the positions and training stalls at the unigram loss. Must be
    false with init 'gpt2' (GPT-2 has no such scale)."""
    tie_embeddings: bool = True
    """Use the input embedding as the output projection."""
    objective: str = "clm"
    """``clm``: the causal LM (next-token prediction, causal attention). ``mlm``: RoBERTa's masked LM
    (Liu et al. 2019): bidirectional attention, RoBERTa's LM head (dense, GELU, LayerNorm, the tied
    decoder plus a vocabulary bias), cross-entropy on the masked positions only, samples from
    :mod:`megaformer.data.mlm`. Needs ``vocab_size >= 50265`` (the ``<mask>`` / ``<s>`` / ``<pad>``
    ids) and ``tie_embeddings``; trains at any tensor / pipeline / data-parallel layout
    (tests/distributed/test_mlm_layouts.py); learned positions are RoBERTa's."""
    mlm_head_positions: str = "all"
    """Where the masked LM's LM head decodes (``model.objective`` mlm only). ``all`` (default, as
    Megatron's BERT and the code before this key): the tied decoder at every position, then the
    loss keeps the masked ones. ``masked`` (as fairseq's RoBERTa, ``masked_tokens``): only at the
    positions chosen for prediction, gathered to a fixed ``floor(0.15·T) + 1`` per row
    (:func:`megaformer.data.mlm.max_masked_positions`, padded with ignored labels, so no host
    sync): the decoder's ``d × V`` matmul, most of a small model's step (87 % of the FLOPs at d
    128, V 50,265), runs on ~16 % of the rows. The same function and gradients up to rounding."""

    @property
    def ffn_size(self) -> int:
        """The FFN intermediate width actually used (resolves 0 to 4 × hidden_size)."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def token_embedding_std(self) -> float:
        """The token embedding init std actually used (resolves 0 to hidden_size^-0.5, or to
        init_std under init 'gpt2')."""
        if self.init == "gpt2":
            return self.embedding_init_std or self.init_std
        return self.embedding_init_std or self.hidden_size**-0.5

    @property
    def head_dim(self) -> int:
        """Per-head width, hidden_size // num_attention_heads."""
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Embedding rows: vocab_size rounded up to a multiple of make_vocab_size_divisible_by × tp."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple


@dataclass(frozen=True)
class DataConfig:
    """Where the training tokens come from and how samples are cut."""

    prefix: str = "data/processed/gutenberg_text_document"
    """Path prefix of a Megatron .bin/.idx pair (without the extension)."""
    valid_fraction: float = 0.02
    """Fraction of documents held out for validation (whole documents, chosen by split_seed)."""
    split_seed: int = -1
    """Seed of the choice of held-out documents (with valid_fraction); -1: train.seed. Set it when
    runs of several train.seed values must be evaluated on the same documents (seeds of one
    comparison: otherwise each seed holds out other documents, and its validation loss moves with
    them, as Megatron's --split and fairseq's separate valid file do not)."""
    eod_token: int = 50256
    """End-of-document token id (GPT-2: <|endoftext|> = 50256). The preflight refuses a dataset
    whose statistics sidecar says its documents end in another token (or in none)."""
    num_workers: int = 0
    """DataLoader worker processes per rank that read and collate samples ahead of the step
    (0: in the training process). The samples are the same for any value."""
    blend: str = ""
    """Several datasets with weights, as Megatron's --data-path: '0.7 data/a_text_document 0.3
    data/b_text_document' (weights >= 0, normalised); when set, prefix is ignored. Each dataset
    gets its weight's share of the samples, within one sample. In the YAML file it may also be a
    list: one 'weight prefix' string per item, [weight, prefix] pairs, or a flat list."""
    valid_prefix: str = ""
    """A separate validation dataset (Megatron's --valid-data-path), e.g. data_tools.split's
    --holdout-prefix output: evaluation reads its documents in order, and training reads every
    document of prefix / blend (valid_fraction is then unused)."""
    test_prefix: str = ""
    """A test dataset (Megatron's --test-data-path), evaluated once after the last step (test/loss,
    test/ppl; summary.json final_test_loss); train.eval_batches × global_batch_size samples."""
    split: str = ""
    """Megatron's --split: 'train,valid,test' shares of prefix's documents, e.g. '969,30,1', cut into
    three contiguous ranges as Megatron does; replaces valid_fraction; not with blend or
    valid_prefix / test_prefix."""
    index_cache_dir: str = ""
    """Directory of the cached sample indices (.npy, built when missing; one per node is fine,
    see python -m data_tools.build_index); empty means <output.dir>/index_cache."""


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout; world size = tp_size × pp_size × data-parallel size."""

    tp_size: int = 1
    """Tensor-parallel degree (Megatron-style): attention heads, FFN width and vocabulary are split
    across this many consecutive ranks; the model computes the same function at any degree."""
    pp_size: int = 1
    """Pipeline-parallel degree: the layer list is cut into this many stages run by DeepSpeed's
    pipeline engine (1: the same layers in one process, no pipeline engine). Gradient accumulation
    steps are the pipeline's micro-batches. ZeRO stages 2 and 3 need pp_size = 1."""
    partition_method: str = "parameters"
    """How DeepSpeed cuts the layers into stages: 'parameters' (balance parameter counts),
    'uniform' (balance layer counts) or 'type:NormFormerBlock' (balance the decoder blocks)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (Korthikanti et al. 2022): the LayerNorm, dropout and residual
    regions hold seq_len / tp_size tokens per rank instead of all of them (less activation memory,
    same function). Needs model.seq_len divisible by tp_size; no effect at tp_size = 1."""
    backend: str = "auto"
    """'auto' (nccl with CUDA, gloo on CPU), 'nccl' or 'gloo'."""
    timeout_minutes: float = 30.0
    """How long a collective may wait for the other ranks before the job fails, for every process
    group (the world, the tp / pp / dp / mp groups, DeepSpeed's own). 30 minutes is DeepSpeed's
    default for the world and torch's default for gloo (torch's NCCL default is 10); raise it when
    a rank may legitimately work alone for longer (a first sample-index build at 300B tokens, a
    slow checkpoint write to a shared file system)."""


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation: batch sizes, schedule, precision, cadence of logs and checkpoints."""

    steps: int = 300
    """Optimizer steps."""
    seed: int = 1234
    """Seed of weights, data order and dropout."""
    micro_batch_size: int = 8
    """Sequences per data-parallel rank per micro-step."""
    global_batch_size: int = 16
    """Sequences per optimizer step, over all data-parallel ranks and accumulation steps."""
    lr: float = 2e-3
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    warmup_steps: int = 30
    """Linear warmup from 0 to lr over this many steps."""
    lr_decay: str = "cosine"
    """'cosine', 'linear' or 'constant' decay after warmup, down to min_lr at the last step; 'ramp':
    the learning-rate stability test (no warmup, no decay): update s uses (s + 1) · lr_ramp."""
    adam_beta1: float = 0.9
    """AdamW β1."""
    adam_beta2: float = 0.98
    """AdamW β2 (the paper uses 0.98)."""
    adam_eps: float = 1e-8
    """AdamW ε."""
    weight_decay: float = 0.01
    """Decoupled weight decay (on the parameters train.weight_decay_params names)."""
    weight_decay_params: str = "matrices"
    """Which parameters take train.weight_decay. 'matrices' (default): weight matrices and
    embeddings; none on biases, LayerNorm gains and shifts, HeadScale and ResScale (GPT practice,
    nanoGPT configure_optimizers). 'all': every parameter, as fairseq (fairseq/optim/adam.py: one
    parameter group, decoupled decay on all), whose runs produced the paper's numbers."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables."""
    precision: str = "fp32"
    """'fp32', 'bf16' or 'fp16' (fp16 uses DeepSpeed's dynamic loss scaling)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage, 0–3."""
    deepspeed_config: str = ""
    """Optional DeepSpeed JSON with engine knobs; batch sizes, optimizer and precision come from
    this YAML and must not appear in it."""
    log_interval: int = 10
    """Console log line every this many steps (TensorBoard gets every step)."""
    eval_interval: int = 50
    """Validation every this many steps, and at the end."""
    eval_batches: int = 4
    """Global batches per validation (Megatron's --eval-iters): the first eval_batches ×
    global_batch_size held-out samples, the same at any data-parallel size."""
    final_eval_batches: int = -1
    """Global batches of the final validation, after the last step: -1 as train.eval_batches (the
    final one reads what every other one reads); 0 every full global batch the held-out documents
    hold (the whole held-out set less a remainder of fewer than global_batch_size samples), so the
    figure runs are ranked by carries no sampling noise of its own; N > 0 the first N batches.
    When it differs from train.eval_batches, the sampled validation still runs at the last step
    (the curve stays comparable) and summary.json's final_valid_loss is this one's, with
    final_valid_loss_sampled and final_valid_tokens beside it. Not charged to a compute budget (it
    measures the run; the budget counts its training and its regular validations). With
    data.valid_prefix or data.split, 0 reads that validation set whole, the same way."""
    save_interval: int = 100
    """Checkpoint every this many steps (and at the end); 0: only at the end."""
    resume: str = "none"
    """'none', 'auto' (the latest checkpoint under output.dir, if any) or a checkpoint directory."""
    init_from: str = ""
    """A checkpoint directory (a run's checkpoints/ or one global_stepN) saved at ANY (tp, pp, dp)
    layout: its module weights and step are loaded, resharded to this run's layout; optimizer
    moments restart from zero (logged). Ignored when train.resume finds a checkpoint. Empty: off."""
    trust_checkpoint_code: bool = False
    """Read train.init_from's files with the full unpickler, which runs any code they carry (a
    warning names each file). Off: the weights-only unpickler, and a file that needs more is
    refused before the run starts. Only for a checkpoint from a source you trust."""
    keep_last_checkpoints: int = 0
    """Keep only the newest this many global_stepN checkpoints (older ones are deleted after each
    save; never the one 'latest' names). 0: keep every checkpoint."""
    exit_signals: str = "SIGTERM,SIGUSR1"
    """Comma-separated signals that make the run save a checkpoint at the next step boundary and
    exit with code 75 (EXIT_CODE_STOPPED); empty: off (the signals keep their default action)."""
    exit_duration_mins: float = 0.0
    """Wall-clock minutes after which the run saves and exits with code 75 at the next step
    boundary (Megatron's --exit-duration-in-mins); counted from this process's start. 0: off."""
    extend_steps: bool = False
    """Allow a resumed run's train.steps to differ from the checkpoint's (extending a run). The
    learning-rate schedule is then rebuilt for the new length (see docs/train.md, "Extending a run")."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass instead of storing them
    (never the embedding); under tensor parallelism without sequence parallelism the saved block
    inputs are partitioned across the TP group. Kept for existing configs: true means
    train.recompute=full."""
    recompute: str = "none"
    """Activation recomputation: none | selective | full. full = recompute each block (as
    train.activation_checkpointing=true, about one more forward, ~33% more compute); selective =
    recompute only the attention core softmax(QKᵀ)V in backward (Korthikanti et al. 2022, Sec. 5,
    Megatron's selective recompute): the [B, heads, T, T] scores, probabilities and dropout mask
    are not stored, for a few % of compute; with a flash / memory-efficient attention kernel
    (bf16/fp16 on GPU) they are not stored anyway and selective saves little."""
    tf32: bool = True
    """Let fp32 matmuls and convolutions use TF32 tensor cores on Ampere and newer GPUs
    (torch.backends.cuda.matmul.allow_tf32, cudnn.allow_tf32): ~8x the fp32 matmul rate with a
    10-bit mantissa in the products (fp32 accumulation). No effect on CPUs or V100, nor on bf16 /
    fp16 runs' half-precision matmuls. false keeps full fp32 products."""
    compile: bool | str = "auto"
    """Compile each decoder block with torch.compile (regional compilation, as torchtitan: one graph
    per block, shared by all blocks; inductor: Triton kernels on GPUs, C++ on CPUs), every
    normalisation scheme, dropout included: the masks are those of eager mode, drawn from the same
    generator states (no graph break; megaformer/parallel/rng_ops.py). true, false, or 'auto' (the
    default): on when the model runs on CUDA, off on CPU (compiling costs tens of seconds per
    process on a small CPU, more than a short run gains). Not with ZeRO-3 (DeepSpeed's parameter
    hooks inside the blocks break the graph) nor where inductor has no compiler: those run eager,
    with the reason in the log. Same losses as eager within fp32 rounding (a test). Where inductor
    works (ZeRO-3 included) the loss's cross-entropy is compiled too: two kernels over the logits
    in their own dtype instead of passes over an fp32 copy (vocab_parallel_cross_entropy fused)."""
    diagnostics_interval: int = 0
    """Every this many steps: per-layer gradient norms (grads/fc2_l1/layer_NN, grads/l2/<op>/layer_NN)
    and learned scales (scales/<op>_mean/layer_NN, histograms) to TensorBoard; 0: off."""
    lr_ramp: float = 0.0
    """With lr_decay='ramp': the learning rate's rise per step (the paper's stability test: 5e-5)."""
    divergence_factor: float = 0.0
    """Stop the run, save it and record diverged_at_step / diverged_at_lr in summary.json when the
    training loss is not finite or exceeds this multiple of its running minimum (e.g. 2.0; reads
    the loss every step). 0: off, a diverging run continues (its non-finite steps counted)."""

    @property
    def recompute_mode(self) -> str:
        """The effective recomputation: 'full' when activation_checkpointing is set, else recompute."""
        return "full" if self.activation_checkpointing else self.recompute


@dataclass(frozen=True)
class BudgetConfig:
    """A compute budget: the run fixes its own length, once, to fill it (``megaformer.training.budget``;
    the paper compares the schemes at equal GPU-hours, Shleifer et al. 2021, Sec. 3). Its own
    section since issue 38; the old ``train.budget_*`` keys are refused with the new name. The run
    asks :class:`megaformer.training.run_length.RunLength` when to stop."""

    device_hours: float = 0.0
    """Compute-matched run length, in device-hours summed over all ranks (0: off, the run takes
    train.steps steps). The run measures its step time over budget.measure_steps steps
    (after BUDGET_SKIP_STEPS = 5 warm-up steps) and one evaluation, fixes once the number of steps
    that fills the budget (at most train.steps, which sizes the data), logs it, and ends the
    learning-rate decay exactly there; the decision is saved in checkpoints, so a resumed run
    keeps it. It must be taken during warmup: train.warmup_steps >= 5 + budget.measure_steps."""
    measure_steps: int = 20
    """Steps whose mean wall-clock time (the slowest rank's) fixes the budget's step count."""
    step_seconds: float = 0.0
    """A calibrated step time (seconds of the job's wall-clock; megaformer.experiments.compare and
    sweep measure every config of a comparison interleaved, so that the machine's drift hits all
    alike): the run fixes its length from it before the first step instead of timing itself,
    and the warmup constraint above does not apply. 0: the run times itself."""
    eval_seconds: float = 0.0
    """One evaluation's calibrated wall-clock seconds, used with budget.step_seconds."""
    fixed_seconds: float = 0.0
    """The calibrated one-time wall-clock seconds of a run (the first steps' warm-up beyond the
    step time, the final checkpoint), taken out of the budget before the length is fixed; used
    with budget.step_seconds."""
    overrun: float = 0.10
    """A budget run whose device-hours so far exceed budget.device_hours by more than this
    fraction ends at that step, evaluated and saved, and its summary says so (budget_stopped_at;
    the log names this key). The run is complete (exit 0), not preempted. A guard against a wrong
    calibration (a step time measured for another config or machine), not against a slow hour:
    the step count is fixed once from the calibration, and a machine that wanders by a few percent
    during the run must not cut it (at 2 %, the CPU reproduction lost 0.3-6.7 % of 4 runs' steps
    to a VM's drift; EXPERIMENTS.md). The comparison's compute is counted in calibrated
    device-hours (steps × calibrated step time), which no drift moves."""
    machine_factor: float = 1.0
    """This machine's step time divided by the calibrated one (budget.step_seconds ...), when
    those were measured on another machine or another day: megaformer.experiments.compare and sweep
    re-measure it when they resume from a saved calibration. The run keeps the step count fixed from
    the calibrated times (the same work as the runs trained before; the budget is in the calibration
    machine's device-hours) and its spend is enforced at budget.device_hours × budget.machine_factor
    × (1 + budget.overrun). 1: the machine of the calibration. Needs budget.step_seconds > 0."""


@dataclass(frozen=True)
class OutputConfig:
    """Where a run writes TensorBoard events and checkpoints."""

    dir: str = "runs/default"
    """Run directory: tensorboard/ and checkpoints/ go under it."""
    wandb_project: str = ""
    """Weights & Biases project to mirror the TensorBoard scalars to (rank 0); empty: off. Needs
    pip install wandb; WANDB_MODE=offline writes under <dir>/wandb without network."""
    wandb_entity: str = ""
    """W&B entity (team or user); empty: your default."""
    wandb_run_name: str = ""
    """W&B run name; empty: W&B picks one."""
    overwrite: bool = False
    """Allow a fresh start (train.resume=none, or auto without a checkpoint) in a directory that
    holds another run's checkpoints: they and its TensorBoard events are deleted first."""
    lock: str = "auto"
    """How the run holds output.dir while it runs (OUTPUT_DIR/run.lock): 'auto', an OS file lock
    (flock), or a lease with a heartbeat where the file system refuses locks; 'lease', a lease only,
    for mounts whose locks are not shared between nodes (NFS with local_lock, nolock)."""
    lease_timeout_seconds: float = 120.0
    """A lease whose heartbeat is older than this is taken over (a killed run's directory is free
    again after it); the holder renews it every quarter of it. The hosts' clocks must agree to well
    within it."""


@dataclass(frozen=True)
class RunConfig:
    """The whole run, as loaded from YAML plus ``key=value`` overrides."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    @property
    def split_seed(self) -> int:
        """The seed that chooses the held-out documents: ``data.split_seed``, or ``train.seed`` when
        it is -1."""
        return self.data.split_seed if self.data.split_seed >= 0 else self.train.seed
