"""What a language-model run is: dataclass configs, named presets (methods: :mod:`.methods`).

A :class:`TrainConfig` fully determines a run (and is what ``config.json`` holds);
the ``*Command`` subclasses add options of one invocation (resume, progress bar,
table jobs) that are not part of the experiment, and hide the fields that do nothing in
that command (``poslsh train`` runs one ``--method``; ``poslsh table`` takes ``--methods``).
``poslsh <command> --help`` shows the comment after each field. Imports nothing heavy
(the CLI builds ``--help`` from this module).
"""
from __future__ import annotations

import copy
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Optional, Tuple

import tyro
from tyro.conf import Suppress

from poslsh_paper.data.tokens import SPLITS, DataConfig
from poslsh_paper.experiments.command import ConfigError
from poslsh_paper.experiments.lm.methods import GPU_METHODS, METHODS, Positional, method_label, parse_method
from poslsh_paper.experiments.paths import check_name, inside

__all__ = ["METHODS", "ModelConfig", "TrainConfig", "TrainCommand", "EvalCommand", "TableCommand", "PRESETS",
           "PRESET_HELP", "NOT_RESULTS", "Positional", "get_preset", "parse_method", "method_label", "check",
           "check_data", "experiment_config", "run_dir", "layout_name", "config_differences", "describe_differences", "GPU_METHODS"]


@dataclass
class ModelConfig:
    kind: str = "scratch"             # "scratch": Qwen3-style, random init; "lora": pretrained + LoRA; "bloom": transformers' BloomForCausalLM, random init, its own ALiBi (trained as method original, evaluated as alibi, alibi-tol1e-<k>, alibi-wcost<s>, poslsh-s<k> through patch_alibi)
    base: str = "smollm2"             # lora base: "smollm2" or a local Hugging Face model directory
    hidden_size: int = 128            # scratch: model width
    num_layers: int = 4               # scratch: decoder layers
    num_heads: int = 8                # scratch: query heads
    num_kv_heads: int = 4             # scratch: key/value heads (GQA)
    head_dim: int = 16                # scratch: dimension per head
    intermediate_size: int = 384      # scratch: MLP width
    lora_r: int = 16                  # LoRA rank (the paper: r 16, alpha 32, dropout 0.05 on q/k/v/o)
    lora_alpha: int = 32              # LoRA alpha
    lora_dropout: float = 0.05        # LoRA dropout
    lora_targets: Tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # modules LoRA adapts


@dataclass
class TrainConfig:
    preset: str = "custom"            # name of the preset this config came from (part of the run directory)
    method: str = "poslsh-s10"        # original, alibi, fixed_blocks, poslsh-s<k> (iid), poslsh-g<k> (grouped), alibi-w<c> (ALiBi cut at c sigma_h), alibi-wcost<s> (ALiBi cut at the window of positional LSH's cost at s)
    seed: int = 0                     # seeds init, data order, partitions and dropout
    data: DataConfig = field(default_factory=DataConfig)     # corpora and tokenizer
    model: ModelConfig = field(default_factory=ModelConfig)  # model shape or LoRA base
    seq_len: int = 256                # training context length
    pack: bool = False                # train on packed documents: positions restart at every separator, no attention across documents (evaluation unchanged)
    batch_size: int = 16              # sequences per optimizer step, over all ranks
    micro_batch_size: int = 16        # sequences per forward pass on one rank (gradient accumulation)
    steps: int = 1000                 # optimizer steps
    lr: float = 1e-3                  # peak learning rate (AdamW, betas 0.9/0.999, eps 1e-8, as in the paper)
    weight_decay: float = 0.01        # AdamW weight decay (not on norms and biases)
    warmup_ratio: float = 0.1         # linear warmup over this fraction of the steps, then linear decay to 0
    grad_clip: float = 1.0            # gradient-norm clip (0 = off)
    fixed_block_size: int = 64        # block size of the fixed_blocks baseline (paper: 512 at 8k context)
    eval_multipliers: Tuple[int, ...] = (1, 2, 4)   # eval context = multiplier x seq_len
    eval_tokens: int = 32768          # scored tokens per eval length (the same tokens for every length)
    eval_batch_tokens: int = 8192     # tokens per eval forward pass
    eval_split: str = "test"          # split evaluated: test, validation or train
    eval_full_context: bool = False   # score only the eval_tokens targets after the longest context's first window: every target has at least (k-1) seq_len tokens before it at every length
    ckpt_interval: int = 200          # steps between checkpoints
    keep_checkpoints: int = 2         # checkpoints kept per run (older ones are deleted)
    device: str = "auto"              # auto | cpu | cuda
    amp: str = "auto"                 # auto | bf16 | off: bf16 autocast on CUDA unless off
    threads: int = 0                  # torch intra-op threads (0 = torch default)
    context_parallel: int = 1         # ranks splitting each sequence (torchrun; poslsh/fixed_blocks): mesh data x this
    runs_dir: str = "runs"            # runs live in <runs_dir>/<preset>/<method>/seed<k>/
    cache_dir: str = ""               # token/tokenizer cache ("" = ~/.cache/poslsh or $POSLSH_CACHE)
    methods: Tuple[str, ...] = METHODS  # methods `poslsh table` runs
    seeds: Tuple[int, ...] = (0, 1, 2)  # seeds `poslsh table` runs


def _hidden(name: str):
    """The :class:`TrainConfig` default of a field that a command does not show."""
    f = TrainConfig.__dataclass_fields__[name]
    return field(default_factory=f.default_factory) if f.default_factory is not MISSING else f.default


# Options of one invocation: never saved in a run's config.json. Fields that do nothing in a
# command are hidden from it (Suppress: they keep the preset's value); a flag naming one is an
# error that says which command it belongs to (Command.elsewhere, in .commands).
@dataclass
class TrainCommand(TrainConfig):
    preset: Suppress[str] = _hidden("preset")
    methods: Suppress[Tuple[str, ...]] = _hidden("methods")
    seeds: Suppress[Tuple[int, ...]] = _hidden("seeds")
    resume: bool = False              # continue the run as recorded (its config.json) from its latest checkpoint
    overwrite: bool = False           # delete an existing run of the same name first
    progress: bool = True             # show a progress bar


@dataclass
class EvalCommand(TrainConfig):
    preset: Suppress[str] = _hidden("preset")
    batch_size: Suppress[int] = _hidden("batch_size")
    micro_batch_size: Suppress[int] = _hidden("micro_batch_size")
    steps: Suppress[int] = _hidden("steps")
    lr: Suppress[float] = _hidden("lr")
    weight_decay: Suppress[float] = _hidden("weight_decay")
    warmup_ratio: Suppress[float] = _hidden("warmup_ratio")
    grad_clip: Suppress[float] = _hidden("grad_clip")
    ckpt_interval: Suppress[int] = _hidden("ckpt_interval")
    keep_checkpoints: Suppress[int] = _hidden("keep_checkpoints")
    context_parallel: Suppress[int] = _hidden("context_parallel")
    methods: Suppress[Tuple[str, ...]] = _hidden("methods")
    seeds: Suppress[Tuple[int, ...]] = _hidden("seeds")
    checkpoint: Optional[str] = None  # checkpoint dir, run dir, checkpoints/latest, or init: the model as built, untrained (default: this run's latest)
    progress: bool = True             # print each length's result as it finishes
    documents: bool = False           # evaluate with documents kept apart, as --pack trains: positions restart at every separator, no attention across documents
    streaming: bool = False           # poslsh, fixed_blocks, the ALiBi windows: the split as one document through the bounded KV cache, PPL vs position


@dataclass
class TableCommand(TrainConfig):
    preset: Suppress[str] = _hidden("preset")
    method: Suppress[str] = _hidden("method")
    seed: Suppress[int] = _hidden("seed")
    # table.md/csv/json go to <out>/<preset>/ (results: the committed reference)
    out: Annotated[str, tyro.conf.arg(aliases=("--results-dir",))] = "outputs"
    dry_run: bool = False             # time a few steps per method and print an estimate; train nothing
    aggregate_only: bool = False      # only tabulate finished runs
    include_runs: str = ""            # an earlier table.json whose runs stand in for missing run directories
    jobs: int = 1                     # runs trained in parallel (subprocesses with cpu_count/jobs threads each)
    progress: bool = True             # show progress bars


def experiment_config(cmd: TrainConfig) -> TrainConfig:
    """The :class:`TrainConfig` part of a command config (what a run saves)."""
    return TrainConfig(**{f.name: getattr(cmd, f.name) for f in fields(TrainConfig)})


def _cpu_model() -> ModelConfig:
    return ModelConfig(hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=16, intermediate_size=384)


PRESET_HELP = {
    "smoke": "generated text (offline, on any machine), a tiny model, 30 steps (end to end on a laptop; "
             "--data.corpora python-doc for real text)",
    "cpu": "Table 1 analog from scratch on 2 CPU cores: 7 methods x 3 seeds, 2800 steps",
    "cpu-long": "the cpu preset with 3x the steps: ALiBi vs PosLSH s=20 i.i.d./grouped",
    "cpu-pack": "the cpu preset on packed documents: ALiBi and PosLSH s=10, 2 seeds",
    "cpu-bloom": "transformers' BloomForCausalLM (its own ALiBi, eager) at 256 tokens, 2 seeds; PPL at 256 to 16k, "
                 "eager and through patch_alibi (exact, certified window, cost-matched window, positional LSH)",
    "gpu": "a larger model at 1024 tokens for one GPU; grouped rows too",
    "smoke-lora": "LoRA on SmolLM2-135M (RoPE replaced), 4 steps",
    "cpu-lora": "Table 2 analog, reduced for 2 CPU cores: 5 methods x 2 seeds, 100 steps",
    "gpu-lora": "the complete fine-tuning table on a GPU",
}

PRESETS = {
    # End-to-end in well under a minute on 2 cores, on any machine: 40 documents of the generated
    # (synthetic) corpus, a 512-token BPE. Nothing to install, so the documented quick run works offline.
    "smoke": TrainConfig(
        preset="smoke", data=DataConfig(corpora=("synthetic",), tokenizer="bpe:512", max_train_docs=40,
                                        max_eval_docs=8),
        model=ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                          intermediate_size=128),
        seq_len=64, batch_size=8, micro_batch_size=8, steps=30, lr=3e-3, fixed_block_size=16,
        eval_tokens=2048, eval_batch_tokens=4096, ckpt_interval=10, seeds=(0, 1)),
    # The from-scratch table (Table 1's analog) on 2 CPU cores in < 3 h: 7 methods x 3 seeds, run as
    # `poslsh table --preset cpu --jobs 2`. Small batches learn far more per token at this scale (the
    # paper uses batch 1): 2 x 256 tokens, 2800 steps = 1.4M tokens per run.
    "cpu": TrainConfig(
        preset="cpu", data=DataConfig(tokenizer="bpe:4096"), model=_cpu_model(),
        seq_len=256, batch_size=2, micro_batch_size=2, steps=2800, lr=3e-3, fixed_block_size=64,
        eval_tokens=32768, eval_batch_tokens=8192, ckpt_interval=400),
    # The longer-training check: the cpu preset with 3x the steps (same warmup ratio and
    # linear decay, so the schedule stretches), ALiBi vs PosLSH s=20 i.i.d. / grouped, 2 seeds;
    # about 2 h with --jobs 2 on 2 cores. Does the gap to ALiBi shrink with training?
    "cpu-long": TrainConfig(
        preset="cpu-long", data=DataConfig(tokenizer="bpe:4096"), model=_cpu_model(),
        seq_len=256, batch_size=2, micro_batch_size=2, steps=8400, lr=3e-3, fixed_block_size=64,
        eval_tokens=32768, eval_batch_tokens=8192, ckpt_interval=400,
        methods=("alibi", "poslsh-s20", "poslsh-g20"), seeds=(0, 1)),
    # The cpu preset on packed documents (--pack): the same windows of the same stream, each split
    # at its separators into documents that see nothing of each other; about 40 min with --jobs 2.
    "cpu-pack": TrainConfig(
        preset="cpu-pack", data=DataConfig(tokenizer="bpe:4096"), model=_cpu_model(),
        seq_len=256, pack=True, batch_size=2, micro_batch_size=2, steps=2800, lr=3e-3, fixed_block_size=64,
        eval_tokens=32768, eval_batch_tokens=8192, ckpt_interval=400, methods=("alibi", "poslsh-s10"), seeds=(0, 1)),
    # ALiBi's own claim on transformers' BLOOM: train short (256, eager, BLOOM's ALiBi), test long
    # (x1, x4, x16, x64 = 256 to 16k) as each of BLOOM_METHODS; each length scores the same 2048
    # targets, each after at least (k-1) x 256 tokens. Training about 30 min per seed on 2 cores,
    # evaluation about 15 (exact ALiBi at 16k is most of it).
    "cpu-bloom": TrainConfig(
        preset="cpu-bloom", data=DataConfig(tokenizer="bpe:4096"), model=ModelConfig(kind="bloom"),
        method="original", seq_len=256, batch_size=2, micro_batch_size=2, steps=2800, lr=3e-3,
        eval_multipliers=(1, 4, 16, 64), eval_tokens=2048, eval_batch_tokens=8192, eval_full_context=True,
        ckpt_interval=400, methods=("original", "alibi", "alibi-tol1e-3", "alibi-wcost10", "poslsh-s10"),
        seeds=(0, 1)),
    # A larger model and context for one GPU (the paper: Qwen3-0.6B at 8k; this is much smaller).
    "gpu": TrainConfig(
        preset="gpu", data=DataConfig(tokenizer="bpe:16384"),
        model=ModelConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                          intermediate_size=1536),
        seq_len=1024, batch_size=32, micro_batch_size=16, steps=6000, lr=5e-4, fixed_block_size=128,
        eval_tokens=131072, eval_batch_tokens=65536, ckpt_interval=500, methods=GPU_METHODS),
    # LoRA fine-tuning of SmolLM2-135M with its RoPE replaced (Table 2's analog).
    "smoke-lora": TrainConfig(
        preset="smoke-lora", data=DataConfig(corpora=("python-doc",), tokenizer="smollm2", max_train_docs=20,
                                             max_eval_docs=4),
        model=ModelConfig(kind="lora"), method="alibi", seq_len=64, batch_size=2, micro_batch_size=2, steps=4,
        lr=1e-4, fixed_block_size=16, eval_tokens=256, eval_batch_tokens=1024, ckpt_interval=2,
        methods=("original", "alibi", "poslsh-s5"), seeds=(0,)),
    # Reduced for 2 CPU cores (about 1.5 h with --jobs 2; SmolLM2 + LoRA trains at ~110 tokens/s
    # per core): 100 steps (102k tokens), five methods (PosLSH s=5 with both samplers), two seeds,
    # and twice the paper's learning rate as the run is short.
    "cpu-lora": TrainConfig(
        preset="cpu-lora", data=DataConfig(tokenizer="smollm2"), model=ModelConfig(kind="lora"),
        seq_len=256, batch_size=4, micro_batch_size=2, steps=100, lr=2e-4, fixed_block_size=64,
        eval_tokens=4096, eval_batch_tokens=2048, ckpt_interval=20,
        methods=("original", "alibi", "poslsh-s5", "poslsh-g5", "fixed_blocks"), seeds=(0, 1)),
    # The complete fine-tuning table on a GPU.
    "gpu-lora": TrainConfig(
        preset="gpu-lora", data=DataConfig(tokenizer="smollm2"), model=ModelConfig(kind="lora"),
        seq_len=1024, batch_size=8, micro_batch_size=8, steps=2000, lr=1e-4, fixed_block_size=128,
        eval_tokens=65536, eval_batch_tokens=32768, ckpt_interval=250,
        methods=("original", "alibi", "poslsh-s1", "poslsh-s5", "poslsh-s10", "poslsh-s20", "poslsh-g5",
                 "poslsh-g10", "fixed_blocks")),
}


def get_preset(name: str) -> TrainConfig:
    """A deep copy of preset ``name`` (mutating it leaves :data:`PRESETS` alone)."""
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def check(cfg: TrainConfig, *, data: bool = True) -> None:
    """Raise :class:`ConfigError` (one line naming the field) for a config no run can use; with
    ``data``, also when its corpora or model are not installed here (before any work)."""
    check_name("preset", cfg.preset)
    parse_method(cfg.method)
    for name in ("steps", "seq_len", "batch_size", "micro_batch_size", "ckpt_interval", "eval_tokens",
                 "eval_batch_tokens"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    if not cfg.eval_multipliers or min(cfg.eval_multipliers) < 1:
        raise ConfigError(f"eval_multipliers must be positive integers, got {cfg.eval_multipliers}")
    c, longest = parse_method(cfg.method).window_sigmas, cfg.seq_len * max(cfg.eval_multipliers)
    if c is not None and c >= longest:
        # ALiBi's sigma_h > 1 at every head count, so every window ceil(c sigma_h) > c covers every key
        raise ConfigError(f"method: {cfg.method} is exact ALiBi in this run (every window ceil(c sigma_h) > c = {c:g} "
                          f"covers the longest sequence it attends, seq_len {cfg.seq_len} x eval multiplier "
                          f"{max(cfg.eval_multipliers)} = {longest}): use --method alibi (one method, one name)")
    if cfg.model.kind not in ("scratch", "lora", "bloom"):
        raise ConfigError(f"model.kind must be 'scratch', 'lora' or 'bloom', got {cfg.model.kind!r}")
    if cfg.model.kind == "bloom":
        from poslsh_paper.experiments.lm.bloom import check_bloom
        check_bloom(cfg)
        if cfg.pack or cfg.context_parallel > 1:
            raise ConfigError("model.kind: bloom runs train unpacked in one process (pack off, context_parallel 1)")
    elif parse_method(cfg.method).window_tol is not None:
        raise ConfigError(f"method: {cfg.method} (a certified window) runs BLOOM's attention through patch_alibi: "
                          "pass --model.kind bloom, or use alibi-w<c> / alibi-wcost<s>")
    choices = {"device": ("auto", "cpu", "cuda"), "amp": ("auto", "bf16", "off"), "eval_split": SPLITS}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}")
    if cfg.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("device: 'cuda' was asked for but this machine has no CUDA device; use --device cpu "
                              "(or auto)")
    if cfg.keep_checkpoints < 1:
        raise ConfigError(f"keep_checkpoints must be at least 1, got {cfg.keep_checkpoints}")
    if not cfg.lr > 0:
        raise ConfigError(f"lr must be > 0, got {cfg.lr}")
    if cfg.threads < 0:
        raise ConfigError(f"threads must be >= 0 (0 = torch's default), got {cfg.threads}")
    if not 1 <= cfg.context_parallel <= cfg.seq_len:
        raise ConfigError(f"context_parallel must be between 1 and seq_len {cfg.seq_len}, got {cfg.context_parallel}")
    if cfg.context_parallel > 1 and parse_method(cfg.method).scheme not in ("poslsh", "fixed_blocks"):
        raise ConfigError(f"context_parallel: method {cfg.method} needs every earlier key (ring attention); "
                          "context parallelism runs poslsh-s<k> and fixed_blocks")
    if cfg.context_parallel > 1 and cfg.pack:
        raise ConfigError("pack: packed documents are not split over context-parallel ranks; train packed runs with "
                          "context_parallel 1")
    check_directory("runs_dir", cfg.runs_dir)
    run_dir(cfg)
    if data:
        check_data(cfg)


def check_data(cfg: TrainConfig) -> None:
    """The corpora of ``cfg.data`` and (LoRA on SmolLM2, the smollm2 tokenizer) the model are
    installed: else one line naming the package, how to install it and the offline way."""
    from poslsh_paper.data.corpus import CORPORA, CorpusNotFound, corpus_files

    names = tuple(cfg.data.corpora)
    offline = "or train offline on generated text with --data.corpora synthetic"
    if names != ("synthetic",):
        unknown = [c for c in names if c not in CORPORA]
        if not names or unknown:
            raise ConfigError(f"data.corpora: unknown corpus {unknown[0] if unknown else '(none)'!r}; choose from "
                              f"{', '.join(CORPORA)}, or synthetic alone (generated text, offline)")
        for name in names:
            try:
                corpus_files(name)
            except CorpusNotFound:
                spec = CORPORA[name]
                raise ConfigError(f"data.corpora: corpus {name!r} is not installed (the Debian package "
                                  f"{spec.package}): install it with `sudo apt-get install {spec.package}`, point "
                                  f"{spec.env} at a copy, {offline}") from None
    if cfg.data.tokenizer == "smollm2" or (cfg.model.kind == "lora" and cfg.model.base == "smollm2"):
        from poslsh_paper.models.smollm2 import INSTALL_HINT, smollm2_available
        if not smollm2_available():
            raise ConfigError(f"model: SmolLM2-135M is not installed (its tokenizer or weights are needed): "
                              f"{INSTALL_HINT}; or use a from-scratch preset (smoke, cpu) with a BPE tokenizer")


def check_directory(name: str, path: str) -> None:
    """An output directory must be a directory (or not exist yet): checked before any work."""
    p = Path(path)
    for parent in (p, *p.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{name}: {parent} is a file, not a directory; choose another {name}")
            break


def layout_name(cfg: TrainConfig) -> str:
    """The directory name of ``cfg``'s preset under ``runs_dir`` and a table's ``out``: the preset,
    with ``-packed`` (or ``-unpacked``) when ``cfg.pack`` is not the preset's own, so packed and
    unpacked runs of one preset never share a directory (``--preset cpu --pack`` -> ``cpu-packed``)."""
    check_name("preset", cfg.preset)
    own = PRESETS[cfg.preset].pack if cfg.preset in PRESETS else False
    return cfg.preset if cfg.pack == own else f"{cfg.preset}-{'packed' if cfg.pack else 'unpacked'}"


def run_dir(cfg: TrainConfig) -> Path:
    """``<runs_dir>/<preset>/<method>/seed<k>``: where a run keeps its checkpoints and results
    (its names checked, and the path checked to stay inside ``runs_dir``); ``<preset>`` is
    :func:`layout_name`."""
    parse_method(cfg.method)
    path = Path(cfg.runs_dir) / layout_name(cfg) / cfg.method / f"seed{int(cfg.seed)}"
    return inside(cfg.runs_dir, path, "runs_dir")


# Fields that do not change what a run computes (where it lives, how it is scheduled): a resumed
# run may change them, and a table compares runs without them.
NOT_RESULTS = ("methods", "seeds", "threads", "runs_dir", "cache_dir", "ckpt_interval", "keep_checkpoints", "device",
               "context_parallel")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_differences(wanted: TrainConfig, recorded: dict) -> dict:
    """``{field: (wanted, recorded)}`` for the fields that change results (not :data:`NOT_RESULTS`)
    on which ``wanted`` and a recorded config dict differ; dotted names for nested fields."""
    from poslsh_paper.experiments.serialize import config_to_dict

    a, b = _flatten(config_to_dict(experiment_config(wanted))), _flatten(recorded or {})
    # A field added after a run was recorded is absent from its record: the run had its default.
    b = {**{k: v for k, v in _flatten(config_to_dict(TrainConfig())).items() if k not in b}, **b} if b else b
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if k.split(".")[0] not in NOT_RESULTS and a.get(k) != b.get(k)}


def describe_differences(diff: dict, other: str) -> str:
    """``steps 30 (recorded 200), lr ...`` from ``{field: (value, other value)}``."""
    return ", ".join(f"{k} {a!r} ({other} {b!r})" if isinstance(a, str) or isinstance(b, str)
                     else f"{k} {a} ({other} {b})" for k, (a, b) in diff.items())
