"""`VAPOConfig`: every knob of VAPO, with the paper's value as the default where it has one (the batch and value
pretraining's early stop aside: `VAPOConfig`'s docstring)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainingArguments
from transformers.training_args import OptimizerNames

from .core import IMPORTANCE_SAMPLING_MODES, SURROGATES
from .distributed import check_deepspeed_config, uses_deepspeed
from .field_checks import check_number_fields, number_list
from .generation import colocated_vllm_seed_problem, generation_kwargs_problem
from .grpo_fields import GRPO_LOSS_TYPES, GRPO_ONLY, GRPO_SURROGATE_LOSS_TYPES, grpo_only_field
from .pretrained import with_dtype_named
from .vllm_fields import VLLMOptions

_LR_SCHEDULES = ("constant_with_warmup", "constant", "linear", "cosine")
# transformers' optimizers (`optim`) that cannot step as VAPOTrainer steps: a part of the name, and why.
_OWN_GROUPS = "it builds its own parameter groups (`optim_target_modules`), and its layer-wise form steps in hooks"
# torchao's low-bit AdamW holds each group's rate as a tensor, which the step checks: the policy's and the critic's
# groups carry their rates as numbers (the first step raised, or, where torchao makes them tensors, the logged rates
# were tensors and the first checkpoint's trainer_state.json could not be written).
_RATES_AS_TENSORS = "torchao's low-bit AdamW needs its rates as tensors; use adamw_8bit (bitsandbytes)"
_OPTIMIZERS_REFUSED = (
    ("schedule_free", "a schedule-free optimizer needs `optimizer.train()` and `.eval()` around every step"),
    ("lomo", "LOMO and AdaLomo update the weights inside the backward pass"),
    ("galore", _OWN_GROUPS),
    ("apollo", _OWN_GROUPS),
    ("adamw_torch_4bit", _RATES_AS_TENSORS),
    ("adamw_torch_8bit", _RATES_AS_TENSORS),
)


@dataclass
class VAPOConfig(VLLMOptions, TrainingArguments):
    r"""Configuration for [`VAPOTrainer`].

    VAPO (arXiv 2504.05118) is PPO with a value model plus seven techniques; the defaults are the paper's wherever
    the paper gives a value, except the batch (one device's: 8 completions a rollout, where the paper samples 512
    prompts x 16) and value pretraining's early stop (`value_pretrain_patience=10`; the paper runs all 50 steps:
    None does the same), and each technique is switched off by configuration alone:

    | technique                  | field(s)                              | VAPO        | off (vanilla PPO)            |
    | -------------------------- | ------------------------------------- | ----------- | ---------------------------- |
    | 1 value pretraining        | `value_pretrain_steps`                | 50          | 0                            |
    | 2 decoupled GAE            | `lam_critic`, `lam_actor`             | 1.0, 0.95   | `lam_critic=0.95`            |
    | 3 length-adaptive GAE      | `length_adaptive_alpha`               | 0.05        | None                         |
    | 4 token-level loss         | `loss_type`                           | "token"     | "sequence"                   |
    | 5 clip-higher              | `epsilon`, `epsilon_high`             | 0.2, 0.28   | `epsilon_high=0.2`           |
    | 6 positive-example NLL     | `nll_coef` (mu)                       | 0.1         | 0.0                          |
    | 7 group sampling           | `num_generations`                     | 8 (paper 16)| 1                            |

    Batch sizes follow TRL's GRPOConfig: a micro-batch is `per_device_train_batch_size` completions per device; an
    optimizer step accumulates `gradient_accumulation_steps` micro-batches; one rollout (generation round) produces
    `generation_batch_size = per_device_train_batch_size * num_processes * steps_per_generation` completions from
    `generation_batch_size / num_generations` prompts, and is trained on for `critic_num_iterations` passes (the
    first `num_iterations` of them also train the policy), i.e.
    `critic_num_iterations * steps_per_generation / gradient_accumulation_steps` optimizer steps. At one policy step
    a rollout (the default: `num_iterations=1`, `steps_per_generation=gradient_accumulation_steps`) the policy's ratio
    is 1 (dropout off) and clip-higher's bounds (technique 5) never bind: they act from the second step on a
    rollout's samples.

    Differences from `TrainingArguments` defaults: `learning_rate=1e-6` (paper), `lr_scheduler_type=
    "constant_with_warmup"` (paper: warm-up then constant; `warmup_steps` stays 0, the paper giving no length),
    `logging_steps=10`, `bf16` on only where the hardware
    supports it (never on CPU), `remove_unused_columns=False` (reward functions read extra columns).
    """

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [
        "model_init_kwargs",
        "generation_kwargs",
        "chat_template_kwargs",
        "transformers_continuous_batching_config",
    ]

    # ---------------------------------------------------------------- TrainingArguments fields with VAPO defaults
    learning_rate: float = field(
        default=1e-6,
        metadata={"help": "Learning rate of the policy (actor) for AdamW. Paper: 1e-6."},
    )
    lr_scheduler_type: str = field(
        default="constant_with_warmup",
        metadata={
            "help": "Learning-rate schedule, applied to the actor and the critic separately: one of "
            f"{', '.join(_LR_SCHEDULES)}, as `transformers.get_scheduler` computes them (`constant` has no warm-up). "
            "The actor's warm-up starts with its first update, after value pretraining; the critic's schedule spans "
            "the planned run (value pretraining's whole budget, then RL) until value pretraining ends, then the run "
            "as it is (value pretraining's steps, then RL: shorter where `value_pretrain_patience` ended it early), "
            "so that a decaying rate reaches 0 at the run's end. "
            "Paper: warm-up then constant, of a length it does not give: `warmup_steps` is 0 (no warm-up) unless set. "
            "(GRPOConfig's default: linear.)"
        },
    )
    max_steps: int = field(
        default=-1,
        metadata={
            "help": "RL optimizer steps to train (overrides `num_train_epochs`; -1: train by epochs; needed when the "
            "dataset has no length, e.g. streamed). Value pretraining's steps come on top of them."
        },
    )
    num_train_epochs: float = field(
        default=3.0,
        metadata={
            "help": "With `max_steps=-1`, the passes over the prompts that size the RL phase: ceil(epochs x rollouts "
            "per epoch) rollouts of `critic_num_iterations` passes each. Value pretraining's rollouts draw prompts "
            "from the same stream before RL, on top of them."
        },
    )
    warmup_steps: float = field(
        default=0,
        metadata={
            "help": "Linear warm-up from 0 to each side's learning rate: a number of steps, or a ratio in [0, 1) of "
            "each side's schedule: the actor's spans the RL steps (critic-only passes beyond `num_iterations` "
            "included), the critic's value pretraining's budget then RL. 0: none (the paper gives no length)."
        },
    )
    max_grad_norm: float = field(
        default=1.0,
        metadata={
            "help": "The policy's and the critic's gradients are clipped separately, each to this norm (one side's "
            "spike never shrinks the other's; logged as `grad_norm/policy` and `grad_norm/critic`). 0: no clipping."
        },
    )
    logging_steps: float = field(
        default=10,
        metadata={"help": "Log every X optimizer steps (an integer, or a float in (0, 1) for a share of the run)."},
    )
    optim: OptimizerNames | str = field(
        default=TrainingArguments.__dataclass_fields__["optim"].default,  # transformers' (fused AdamW on torch 2.8+)
        metadata={
            "help": "The optimizer of the policy and the critic (each side its own parameter groups): transformers' "
            "`OptimizerNames` but the schedule-free ones, LOMO and AdaLomo, GaLore and APOLLO, and torchao's low-bit "
            "AdamW (adamw_torch_4bit, adamw_torch_8bit: bitsandbytes' adamw_8bit is accepted), which VAPO refuses."
        },
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "The checkpoint `trl-vapo train` resumes from: a checkpoint folder; `latest` (or `true`): the "
            "newest readable one in output_dir; `auto`: that one where output_dir holds a checkpoint, else a fresh "
            "start (a preemptible job's one command); `false`: none (turns a config's off). In Python, pass it to "
            "`trainer.train(resume_from_checkpoint=...)` (True for `latest`), which reads it from there."
        },
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Train with bf16 mixed precision. Default: on for a CUDA GPU that computes in bf16 natively "
            "(Ampere on) unless fp16 is asked for, off elsewhere (CPU and Apple MPS train in float32)."
        },
    )
    remove_unused_columns: bool | None = field(
        default=False,
        metadata={"help": "Kept False: reward functions receive every dataset column (e.g. the gold `answer`)."},
    )
    log_completions: bool = field(
        default=False,
        metadata={
            "help": "Log a table of the latest rollout's prompts and completions at each logging step: each reward "
            "function's score, the sequence reward, the mean advantage and the critic's value at the first and last "
            "token. Printed (with `rich` when installed, else as plain text), written to "
            "`output_dir/completions/completions_<step>.parquet`, and logged as a table to wandb and trackio when "
            "they are in `report_to`; once per rollout."
        },
    )
    plot_diagnostics: bool = field(
        default=True,
        metadata={
            "help": "Write PNGs of the training curves and of the mean value / advantage / return by response "
            "position to `output_dir/plots/` at the end of value pretraining and of training (needs matplotlib: "
            "`pip install matplotlib`). `trl-vapo plot OUTPUT_DIR` redraws them at any time."
        },
    )
    diagnostic_position_buckets: int = field(
        default=8,
        metadata={
            "help": "Position buckets of the logged `by_position/{value,advantage,return}/<a>-<b>` means (equal "
            "shares of max_completion_length): VC-PPO's check for a biased critic."
        },
    )
    num_completions_to_print: int | None = field(
        default=None,
        metadata={"help": "Number of completions to print (a random sample of the rollout). None: all of them."},
    )

    # ------------------------------------------------------------------------------------------ model loading
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for `from_pretrained` when `model`, `value_model` or a reward model is given "
            'as a name or path, e.g. `{"dtype": "bfloat16"}`. Default dtype: float32 for the policy and the critic; '
            'a reward model loads in its saved dtype ("auto") unless a dtype is given here (on the command line '
            "`--dtype`, whose default float32 is passed here, so a reward model loads in float32 there too, as with "
            "`trl grpo`)."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Allow models and tokenizers that ship their own Python code. Off unless you ask."},
    )
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Set every dropout probability to 0 in the policy and critic, so the old and new "
            "log-probabilities of the PPO ratio come from the same function. (GRPOConfig's default: False.)"
        },
    )

    # ------------------------------------------------------------------------------------- data and generation
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Prompts longer than this many tokens are truncated from the left (counted and said before "
            "training; a streamed data set's said at the first; see drop_long_prompts): the start of the rendered "
            "prompt goes, with a chat template its first tokens and system message, as GRPOTrainer cut them before "
            "TRL 1.0; reward functions still get the whole prompt. Not a rollout_func's prompts (used as given). "
            "None (default): no limit, as in TRL's GRPOTrainer (TRL 1.16 has no such setting)."
        },
    )
    max_completion_length: int = field(
        default=512,
        metadata={
            "help": "Maximum number of generated tokens per completion. The paper trains long chains of thought; "
            "its lengths are not in this project's sources (VC-PPO's contexts: 8k and 16k tokens)."
        },
    )
    num_generations: int = field(
        default=8,
        metadata={
            "help": "Group sampling: completions sampled per prompt. Paper: 16 (512 prompts x 16). 1 turns group "
            "sampling off (one sample per prompt, as vanilla PPO)."
        },
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions generated per rollout over all processes. Default: "
            "`per_device_train_batch_size * num_processes * steps_per_generation`. Set it or `steps_per_generation` "
            "(both only where they agree); a multiple of `num_generations` and of whole optimizer steps "
            "(`per_device_train_batch_size * num_processes * gradient_accumulation_steps`)."
        },
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-batches per rollout on each process. Default: `gradient_accumulation_steps` (one optimizer "
            "step per rollout and iteration). Must be a multiple of `gradient_accumulation_steps`."
        },
    )
    temperature: float = field(
        default=1.0,
        metadata={"help": "Sampling temperature of the rollouts; log-probabilities use the same temperature."},
    )
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling of the rollouts (1.0: off)."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling of the rollouts (0: off)."})
    min_p: float | None = field(
        default=None,
        metadata={"help": "Min-p sampling of the rollouts: drop tokens below min_p x the top token's probability."},
    )
    repetition_penalty: float = field(default=1.0, metadata={"help": "Repetition penalty of the rollouts (1.0: off)."})
    generation_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": 'Extra `GenerationConfig` arguments for the rollouts, e.g. `{"stop_strings": ["</answer>"]}`.'
        },
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Extra arguments for the chat template of conversational prompts."},
    )

    # ------------------------------------------------------------------- generation engines (TRL's names)
    use_transformers_continuous_batching: bool = field(
        default=False,
        metadata={
            "help": "Generate the rollouts with transformers' continuous-batching engine (paged attention, requests "
            "join and leave the batch one by one)."
        },
    )
    transformers_continuous_batching_config: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `transformers.generation.ContinuousBatchingConfig`."},
    )
    use_static_cache_engine: bool | None = field(
        default=None,
        metadata={
            "help": "Generate the rollouts with trl-vapo's static-cache engine (`trl_vapo.static_cache."
            "StaticCacheEngine`): a decode loop on transformers' StaticCache whose step has fixed shapes and no host "
            "synchronisation, captured as a CUDA graph on a GPU, sampling exactly as generate() does (settings it "
            "cannot serve exactly, such as repetition_penalty or stop strings, fall back to generate(), with a "
            "warning where the engine was named, logged at INFO level where it was the default). None (default): on "
            "a CUDA GPU without DeepSpeed or FSDP, for an unquantized base, when no other engine is chosen and no "
            "cache_implementation other than 'static' or 'dynamic' is (on an H200, a VAPO LoRA step at Qwen2.5-0.5B "
            "shapes took 0.34x the time with it), generate() elsewhere (on the CPU generate() gave 1.06-1.12x its "
            "tokens/s in one benchmark run); under DeepSpeed or FSDP, when chosen, its step runs "
            "without a CUDA graph. Not in GRPOConfig."
        },
    )
    static_cache_compile: bool = field(
        default=False,
        metadata={
            "help": "Compile the static-cache engine's decode step with torch.compile (fixed shapes, one graph, no "
            "CUDA graphs of its own) before its CUDA graph is captured; opt-in. Its fused kernels round differently "
            "from the eager step, so greedy completions may part from generate()'s at a near-tie. Each prompt-width "
            "bucket compiles once (about 50 s at Qwen2.5-0.5B shapes on an H200), and a step torch.compile cannot "
            "compile runs as written, with one warning. On an H200, one run each: 16,758 tokens/s with it and 16,367 "
            "without, at Qwen2.5-0.5B shapes, 64 x 512, bf16 (no interval: no difference claimed; "
            'benchmarks/README.md, "GPU runs"). Only with the '
            "static-cache engine. Not in GRPOConfig."
        },
    )
    use_vllm: bool = field(
        default=False,
        metadata={
            "help": "Generate the rollouts with vLLM (through TRL's `VLLMGeneration`) instead of model.generate(); "
            "the policy's weights (under PEFT: the base merged with the policy adapter, never the critic's) are "
            "pushed to vLLM before each rollout that follows an optimizer step (once per rollout, however many steps "
            "it trains). Requires `pip install vllm`."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Correct the policy loss for the mismatch between vLLM's log-probs and the trainer's (TRL's "
            "importance sampling): each token's loss is weighted by pi_trainer / pi_vllm, per token or per sequence."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "'token_truncate', 'token_mask', 'sequence_truncate' or 'sequence_mask': weights per token or one "
            "per completion; out-of-bounds weights clipped to the bounds (truncate) or set to 0 (mask)."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound C_max of the importance-sampling weights."}
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound C_min of the importance-sampling weights (None: none)."}
    )
    shuffle_dataset: bool = field(default=True, metadata={"help": "Shuffle the prompts each epoch."})
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "Leave completions that hit `max_completion_length` without an EOS out of every loss (DAPO's "
            "overlong filtering). Off by default: VAPO lets the verifier score them."
        },
    )

    # --------------------------------------------------------------------------------------- rewards
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "Weight of each reward function in the sequence reward. Default: 1 for each."},
    )
    positive_reward_threshold: float = field(
        default=0.5,
        metadata={
            "help": "A completion whose (weighted) reward is at least this is 'positive' (correct): it feeds the "
            "positive-example NLL loss and the `accuracy` metric. 0.5 suits both the +1/-1 and the 1/0 verifier."
        },
    )
    positive_reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "The reward functions, by name, that judge correctness: a completion is positive when their "
            "weighted sum is at least `positive_reward_threshold` (the paper's NLL loss imitates the correct "
            "answers). None: every reward function's sum, which with a format reward beside the verifier counts a "
            "wrong but well-formatted answer as correct (a warning says so where nll_coef > 0)."
        },
    )

    # ---------------------------------------------------------------------------------------- PPO objective
    num_iterations: int = field(
        default=1,
        metadata={"help": "Passes over each rollout (PPO epochs)."},
    )
    critic_num_iterations: int | None = field(
        default=None,
        metadata={
            "help": "Passes of the critic over each RL rollout, at least `num_iterations` (default: equal to it). The "
            "passes beyond `num_iterations` are critic-only optimizer steps (counted in `max_steps`): more critic "
            "training per sample, without new samples, as Open-Reasoner-Zero does. Value pretraining's passes are "
            "`value_pretrain_num_iterations`."
        },
    )
    epsilon: float = field(
        default=0.2,
        metadata={"help": "Lower clip range epsilon_low: the ratio is clipped below at 1 - epsilon. Paper: 0.2."},
    )
    epsilon_high: float | None = field(
        default=0.28,
        metadata={
            "help": "Clip-higher: upper clip range, the ratio is clipped above at 1 + epsilon_high. Paper: 0.28. "
            "None: equal to `epsilon` (symmetric clipping, vanilla PPO). It acts only where a rollout trains more "
            "than one optimizer step (steps_per_generation > gradient_accumulation_steps, or num_iterations > 1; "
            "the paper: 16): with one, the ratio is 1. (GRPOConfig's default: None.)"
        },
    )
    loss_type: str = field(
        default="token",
        metadata={
            "help": "'token': average the policy loss over all valid tokens of the optimizer step, across "
            "micro-batches and processes (VAPO). 'sequence': average per sequence, then over sequences (vanilla PPO). "
            "'luspo': sum per sequence, then average over sequences (GRPOConfig's LUSPO). GRPOConfig's names are "
            "accepted: 'dapo' (the same as 'token'), 'bnpo' and 'dr_grpo' (token-level with another normaliser: here "
            "'token') and 'grpo' ('sequence'); 'cispo' and 'vespo' set `surrogate` and 'token', 'sapo' sets "
            "`surrogate` and 'sequence', as GRPOTrainer averages those losses. The per-sequence averages count the "
            "step's sequences that have a token in the loss (GRPOTrainer counts every row, those "
            "mask_truncated_completions or an unscored reward leave empty too), and 'token' the step's own tokens "
            "(GRPOTrainer's 'dapo' divides by the rollout's mean tokens per step)."
        },
    )
    surrogate: str = field(
        default="ppo",
        metadata={
            "help": "The per-token policy objective on VAPO's advantages: 'ppo' (default, the paper's Eq. 8: PPO's "
            "clipped ratio with clip-higher), or GRPOConfig's other losses: 'cispo' (MiniMax-M1: the importance "
            "weight capped at `epsilon_high`, e.g. 5.0, times A log pi), 'sapo' (a soft sigmoid gate for the clip, "
            "`sapo_temperature_pos`/`_neg`), 'vespo' (a smooth gamma weight of the sequence's ratio, `vespo_*`). "
            "GRPO's loss_type='cispo', 'sapo' or 'vespo' sets it."
        },
    )
    nll_coef: float = field(
        default=0.1,
        metadata={
            "help": "mu, the weight of the positive-example LM (NLL) loss on correct completions. Paper: 0.1. "
            "0 leaves it out. Its log-probabilities are the policy loss's, at `temperature` (the paper evaluates "
            "at 1.0 and gives no training temperature)."
        },
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": "Per-token KL penalty to the initial policy, subtracted from the reward (beta * "
            "(log pi_old - log pi_ref)). Paper: 0 (no KL); with 0 no reference model is kept."
        },
    )

    # ------------------------------------------------------------------------------------ advantages (GAE)
    gamma: float = field(default=1.0, metadata={"help": "Discount factor. Paper: 1.0."})
    lam_actor: float = field(
        default=0.95,
        metadata={
            "help": "Decoupled GAE: lambda of the policy's advantages when `length_adaptive_alpha` is None. "
            "Paper (VC-PPO): 0.95."
        },
    )
    lam_critic: float = field(
        default=1.0,
        metadata={
            "help": "Decoupled GAE: lambda of the critic's targets in RL (value pretraining always uses 1). Paper: "
            "1.0 (unbiased Monte-Carlo returns). Vanilla PPO uses one lambda for both: set it equal to `lam_actor`, "
            "with `length_adaptive_alpha=None`."
        },
    )
    length_adaptive_alpha: float | None = field(
        default=0.05,
        metadata={
            "help": "Length-adaptive GAE: each completion of length l gets lambda_actor = 1 - 1/(alpha * l), "
            "clamped to [0, 1] (0 up to 1/alpha tokens: 20 at 0.05). Paper: 0.05. None: every completion uses "
            "`lam_actor`."
        },
    )
    whiten_advantages: bool = field(
        default=True,
        metadata={
            "help": "Normalise the advantages to zero mean and unit variance over all valid tokens of the rollout. "
            "Not in the paper: the PPO baseline it builds on (verl) whitens; one shift and scale for every token, so "
            "the length-adaptive weighting is kept."
        },
    )

    # ----------------------------------------------------------------------------------------------- critic
    critic_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Learning rate of the critic. Default: 2 x `learning_rate` (paper: 2e-6 vs 1e-6)."},
    )
    vf_coef: float = field(
        default=0.1,
        metadata={
            "help": "Weight of the value loss: the critic's gradient is that of vf_coef x L_V. Actor and critic share "
            "no trainable weight and each has its own optimizer group; an Adam step barely depends on the scale of "
            "the gradient (Lion's and Adafactor's neither), so there vf_coef mainly sets where the critic's gradient "
            "is clipped: max_grad_norm / vf_coef in units of L_V's own gradient (10 with the defaults). With sgd it "
            "scales the critic's step too. It weights L_V in the logged `loss`. To make the critic learn faster or "
            "slower, change critic_learning_rate."
        },
    )
    cliprange_value: float | None = field(
        default=0.2,
        metadata={
            "help": "Clip the critic's new values to old +/- this in the value loss (PPO), during RL. None: no "
            "clipping. The papers give no value clip (0.2: PPO's clip range); with critic_num_iterations > 1 it "
            "caps how far the extra passes move a value. Value pretraining never clips: it is plain regression on "
            "Monte-Carlo returns (VC-PPO)."
        },
    )

    # ------------------------------------------------------------------------------------- value pretraining
    value_pretrain_steps: int = field(
        default=50,
        metadata={
            "help": "Value pretraining: rollouts from the frozen initial policy that train only the critic, on "
            "Monte-Carlo returns (lambda = 1), before the first policy update. Paper: 50 (VC-PPO: 100), of the "
            "paper's rollouts (512 prompts x 16 samples): each of this config's is generation_batch_size samples "
            "(8 a process by default), so the critic sees far fewer. 0: off. "
            "Skipped when `value_model` was saved by a previous value pretraining of this initial policy with the "
            "same rewards, sampling, max_prompt_length and gamma (else it is an initialisation, pretrained again, "
            "with a warning; the data set is not compared), or is a frozen value function (a `ValueFunction`, which "
            "learns nothing)."
        },
    )
    value_pretrain_num_iterations: int | None = field(
        default=None,
        metadata={
            "help": "Passes of the critic over each value-pretraining rollout (each a shuffled pass of optimizer "
            "steps, which come on top of `max_steps`: it counts RL's). Default: equal to `num_iterations`. The "
            "policy is frozen while the critic pretrains, so more passes reuse samples of the same distribution (the "
            "`chains` benchmark's critic tuning tries 4-16: benchmarks/README.md). The paper does not say (one pass)."
        },
    )
    value_pretrain_replay: int = field(
        default=0,
        metadata={
            "help": "Value pretraining's replay: the critic's optimizer steps on a rollout draw their samples from it "
            "and the up to this many value-pretraining rollouts before it on the same process (the policy is frozen, "
            "so all are samples of one distribution). Each pass is still one rollout's worth of samples, so the steps "
            "are as many and as large as without replay. Checkpoints hold the window: a resumed run replays the same "
            "rollouts. 0: each rollout alone (the paper)."
        },
    )
    value_pretrain_patience: int | None = field(
        default=10,
        metadata={
            "help": "Stop value pretraining early when the median explained variance of the last this-many rollouts "
            "is less than `value_pretrain_min_delta` above the median of the this-many before them (rollouts whose "
            "returns are all equal, and so have no explained variance, are not counted). None: always run "
            "`value_pretrain_steps`, as the paper does (a fixed 50; this stop rule is trl-vapo's, and can end a slow "
            "but steady rise early)."
        },
    )
    value_pretrain_min_delta: float = field(
        default=0.01,
        metadata={"help": "Smallest gain of the windowed median explained variance that counts as still improving."},
    )

    # ------------------------------------------------------------------------------------------- robustness
    drop_long_prompts: bool = field(
        default=False,
        metadata={
            "help": "Drop training prompts longer than `max_prompt_length` tokens instead of truncating them from the "
            "left. Either way a data set with a length has them counted, with one warning, before training starts; a "
            "streamed one's are dropped as they come (uncounted), or truncated with a warning at the first. Not with "
            "a rollout_func, whose prompt ids are its own (a warning says so)."
        },
    )
    nonfinite_loss_patience: int = field(
        default=3,
        metadata={
            "help": "An optimizer step whose loss or gradient norm is NaN or inf is skipped (counted in "
            "`skipped_steps`); this many with no update applied since the first of them (a step that trains "
            "nothing, or an fp16 loss-scale overflow, is none) stop the run with an error, leaving the last "
            "checkpoint intact."
        },
    )

    # ----------------------------------------------------- GRPOConfig's other fields: a GRPO script's config runs
    num_generations_eval: int | None = field(
        default=None,
        metadata={
            "help": "Completions per prompt when evaluating on `eval_dataset` (None: `num_generations`), as in "
            "GRPOConfig: fewer make evaluation cheaper."
        },
    )
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "Store the policy's (and reference's) LM head in float32 and compute the logits in float32 under "
            "bf16/fp16 mixed precision, as the ScaleRL recipe recommends (TRL's option). Not with a PEFT adapter on "
            "the head."
        },
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={
            "help": "DeepSpeed ZeRO-3: gather the policy's weights for generation (fast). False generates with the "
            "weights sharded, slower, for a policy larger than one GPU. Not with vLLM, which needs the whole weights."
        },
    )
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={
            "help": "Pad the prompts and the completions of every forward pass that scores or trains, and the "
            "prompts generate() samples from (as TRL), to a multiple of this many tokens. "
            "'auto': 128 on Neuron (AWS Trainium, which compiles once per input shape), no padding elsewhere."
        },
    )
    cache_implementation: str | None = field(
        default=None,
        metadata={
            "help": "KV-cache implementation of model.generate() (e.g. 'static', 'offloaded'), where generate() "
            "samples: another than 'static' or 'dynamic' keeps generate() on a CUDA GPU (the static-cache engine, the "
            "default there, keeps its own static cache; named with use_static_cache_engine=True, it sends such "
            "rollouts to generate(), with a warning); refused with vLLM and continuous batching."
        },
    )
    log_unique_prompts: bool = field(
        default=False,
        metadata={
            "help": "In the completions table logged to wandb / trackio, each prompt once (its first completion)."
        },
    )
    log_multimodal: bool = field(
        default=True,
        metadata={
            "help": "GRPOConfig's, accepted without effect: VAPO trains on text prompts, no image or video to log."
        },
    )
    use_transformers_paged: bool = field(
        default=False,
        metadata={"help": "Deprecated (as in TRL): use `use_transformers_continuous_batching`."},
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None,
        metadata={"help": "Deprecated (as in TRL): use `vllm_importance_sampling_clip_max`."},
    )
    delta: float | None = field(
        default=None,
        metadata={
            "help": "Two-sided clipping (INTELLECT-2; GRPOConfig's `delta`): the ratio in the unclipped term of the "
            "policy loss is capped at delta, bounding the loss of a negative advantage whose ratio grows. Must be > 1 "
            "+ epsilon_high. With surrogate='ppo' only (the other surrogates ignore it). None (default, as the "
            "paper): no cap."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "An entropy bonus: entropy_coef times the step's token mean of the policy's entropy (over the "
            "top-entropy tokens under top_entropy_quantile) is subtracted from the policy loss, as GRPOConfig's "
            "`entropy_coef`; with `use_adaptive_entropy`, the coefficient it starts from. 0.0 (default, as the "
            "paper: Eq. 8-10 have no entropy term): off."
        },
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "Skywork-OR1's adaptive entropy control, as GRPOConfig's: after each applied optimizer step that "
            "trains the policy, the entropy "
            "bonus's coefficient (from `entropy_coef`) rises by `entropy_coef_delta` while the step's entropy is at "
            "or below `entropy_target` and falls otherwise, within [entropy_coef_min, entropy_coef_max]; the bonus "
            "applies only while the entropy is at or below the target. Checkpointed. False (default, as the paper): "
            "off."
        },
    )
    entropy_coef_min: float = field(
        default=0.0, metadata={"help": "With use_adaptive_entropy: the coefficient's lower bound (GRPO's 0.0)."}
    )
    entropy_coef_max: float = field(
        default=1.0, metadata={"help": "With use_adaptive_entropy: the coefficient's upper bound (GRPO's 1.0)."}
    )
    entropy_coef_delta: float = field(
        default=0.005, metadata={"help": "With use_adaptive_entropy: the coefficient's step (GRPO's 0.005)."}
    )
    entropy_target: float = field(
        default=0.2,
        metadata={
            "help": "With use_adaptive_entropy: the target token-mean entropy in nats, measured over the tokens the "
            "bonus acts on (the top-entropy ones under top_entropy_quantile). GRPO's default 0.2 engages only near "
            "collapse: set it near the `entropy` logged early in training."
        },
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "How several reward functions' scores become a completion's reward, as GRPOConfig's: "
            "'sum_then_normalize' (default, VAPO's): their weighted sum (GRPO then normalises it per group; VAPO's "
            "critic needs no normalisation); 'normalize_then_sum' (GDPO): each function's scores standardised within "
            "the prompt's group, then weighted and summed, the reward GAE and the critic see. Accuracy, the NLL's "
            "positive examples and the logged rewards read the scores themselves.",
            "choices": ["sum_then_normalize", "normalize_then_sum"],
        },
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "Beyond the 80/20 Rule's token filter, as GRPOConfig's: the PPO term (and an entropy bonus) "
            "trains only on the top-rho share of each micro-batch's tokens by entropy, pooled over processes; "
            "the NLL and value losses keep every token. The 80/20 paper recommends 0.2; VAPO has no such filter. "
            "1.0 (default): every token."
        },
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "DeepSeek-V3.2's off-policy sequence mask (Eq. 9), as GRPOConfig's: a token with a negative "
            "advantage does not train when its sequence's mean log-ratio log pi_sampler - log pi (an estimate of "
            "KL(sampler || policy)) exceeds this threshold, e.g. 0.5. The sampler is vLLM's log-probs or a "
            "rollout_func's, else the policy's before the rollout's first update (no drift with one update per "
            "rollout). None (default, as VAPO): off."
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "help": "'token' (default, as the paper's Eq. 8): a ratio per token. 'sequence': GSPO's sequence-level "
            "ratio in its GSPO-token form, which keeps VAPO's per-token advantages: every token of a completion "
            "takes the completion's geometric-mean ratio, clipped as one (GRPOConfig's field).",
            "choices": ["token", "sequence"],
        },
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "TR-DPO's reference syncing, as GRPOConfig's: every `ref_model_sync_steps` steps the reference "
            "policy (used when beta > 0) becomes ref_model_mixup_alpha x policy + (1 - alpha) x reference. Full "
            "fine-tuning only (with PEFT the reference is the base without adapters). False (default, as the "
            "paper): the reference stays the initial policy."
        },
    )
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "With sync_ref_model: the policy's share of each sync (TR-DPO: 0.6)."}
    )
    ref_model_sync_steps: int = field(
        default=512,
        metadata={
            "help": "With sync_ref_model: optimizer steps between syncs (TR-DPO: 512), counted as global_step counts "
            "them: value pretraining's and the critic-only passes' steps too, not the policy's updates alone."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Mixture-of-Experts policies: the weight of the router's load-balancing loss, added to the "
            "policy's loss (never the critic's) and logged as `aux_loss`, as GRPOTrainer adds it. None: the model "
            "config's own `router_aux_loss_coef` (0 where it declares none); 0: off. Not in the paper (dense models)."
        },
    )
    sapo_temperature_pos: float = field(
        default=1.0,
        metadata={"help": "With surrogate='sapo': the gate's temperature where the advantage is > 0 (GRPO's 1.0)."},
    )
    sapo_temperature_neg: float = field(
        default=1.05,
        metadata={"help": "With surrogate='sapo': the gate's temperature elsewhere (GRPO's 1.05)."},
    )
    vespo_k_pos: float = field(
        default=2.0,
        metadata={"help": "With surrogate='vespo': the weight's power k where the advantage >= 0 (GRPO's 2.0)."},
    )
    vespo_lambda_pos: float = field(
        default=3.0,
        metadata={"help": "With surrogate='vespo': the weight's decay lambda where the advantage >= 0 (GRPO's 3.0)."},
    )
    vespo_k_neg: float = field(
        default=3.0,
        metadata={"help": "With surrogate='vespo': the weight's power k where the advantage < 0 (GRPO's 3.0)."},
    )
    vespo_lambda_neg: float = field(
        default=2.0,
        metadata={"help": "With surrogate='vespo': the weight's decay lambda where the advantage < 0 (GRPO's 2.0)."},
    )
    # GRPOConfig's switches for features VAPO does not have: GRPO's default (the feature off, or GRPO's own
    # normalisation, which VAPO's critic replaces) is accepted so that a GRPO config runs; any other value is refused.
    scale_rewards: str = grpo_only_field("scale_rewards")
    use_bias_correction_kl: bool = grpo_only_field("use_bias_correction_kl")
    max_tool_calling_iterations: int | None = grpo_only_field("max_tool_calling_iterations")
    log_completions_hub_repo: str | None = grpo_only_field("log_completions_hub_repo")

    def __post_init__(self):
        for name in ("eval_strategy", "save_strategy", "logging_strategy"):
            if getattr(self, name) is False:  # YAML 1.1 reads `save_strategy: no` (unquoted) as false
                setattr(self, name, "no")
        self._check_number_fields()
        self._settings_as_given()
        super().__post_init__()
        self._accept_grpo_spellings()
        # The defaults derived from other fields are marked so (`Derived`): a copy (`dataclasses.replace`, which
        # passes every field) derives them again from its own values (a copy with another learning_rate kept the
        # critic's 2 x the old one, one with another epsilon the old symmetric bound), and so does a field set later
        # (a hyperparameter search's `setattr`).
        for name in ("critic_learning_rate", "critic_num_iterations", "value_pretrain_num_iterations"):
            setattr(self, name, given(getattr(self, name)))
        self._derive_defaults()
        self._resolve_batch_sizes()
        self._validate_warning_once()
        self._initialized = True

    def _derive_defaults(self) -> None:
        """The fields left to their defaults (None, or derived before: `Derived`) from the ones they follow."""
        if given(self.critic_learning_rate) is None:
            self.__dict__["critic_learning_rate"] = DerivedFloat(2 * self.learning_rate)
        for name in ("critic_num_iterations", "value_pretrain_num_iterations"):
            if given(getattr(self, name)) is None:
                self.__dict__[name] = DerivedInt(self.num_iterations)
        if given(self.epsilon_high) is None:  # symmetric clipping: the bound follows epsilon
            self.__dict__["epsilon_high"] = DerivedFloat(self.epsilon)

    def __setattr__(self, name: str, value: Any) -> None:
        initialized = self.__dict__.get("_initialized")
        if initialized:  # set from outside: given (transformers' hyperparameter search casts a value to its
            value = plain(value)  # field's type: the marker too)
        super().__setattr__(name, value)
        if initialized and name in ("learning_rate", "num_iterations", "epsilon", "epsilon_high"):
            self._derive_defaults()  # (what follows it follows it again; a given value stays)

    def _settings_as_given(self) -> None:
        """The checks and readings of the fields as given, before transformers' own (`__post_init__`), and again in
        `check_again` for fields set since: one that contradicts another refused, one given as text or a scalar read
        as the mapping or list it stands for."""
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _has_gpu():
            # `torchrun` on a machine without GPUs: transformers only sets up CPU data parallelism (gloo) when told
            # `use_cpu`; without it every process would silently train alone on the same output folder.
            self.use_cpu = True
        fp16 = fp16_asked(self.fp16)
        if fp16 and (uses_deepspeed(self) or self._uses_fsdp()):
            # DeepSpeed's and FSDP2's fp16 bring loss scalers of their own, which VAPO's separate clipping of the
            # policy's and the critic's gradients has not been made to work with.
            raise ValueError(
                "fp16=True is supported on one process and under DDP, not with DeepSpeed or FSDP: use bf16 there (a "
                "GPU from Ampere on: leave bf16 unset), or float32 with LoRA."
            )
        if self.load_best_model_at_end and (uses_deepspeed(self) or self._uses_fsdp()):
            # The best checkpoint's weights would load into sharded models: not built for either.
            raise ValueError(
                "load_best_model_at_end=True is not supported under DeepSpeed or FSDP: the run ends with the weights "
                "it trained last. trainer.state.best_model_checkpoint names the best checkpoint (kept by "
                "save_total_limit); load its policy with from_pretrained."
            )
        if self.load_best_model_at_end and not self.metric_for_best_model:
            # transformers would take the lowest eval_loss, which is VAPO's loss: with whitened advantages the policy
            # term averages to about 0, so it ranks checkpoints by the critic's error, not by how well they solve.
            raise ValueError(
                "load_best_model_at_end=True needs metric_for_best_model: without it the best checkpoint is the one "
                "with the lowest eval_loss, which in VAPO is mostly the critic's error (the policy's term of whitened "
                "advantages averages to about 0). Name what the best one does best, e.g. "
                "metric_for_best_model='accuracy' or 'reward' ('loss' keeps the eval loss)."
            )
        if self.bf16 is None:
            self.bf16 = default_bf16(fp16, self.use_cpu)
        if self.bf16 and not self.use_cpu and not _bf16_accelerator():  # what transformers refuses, and its fix
            raise ValueError(
                "bf16=True needs an accelerator with bf16 (a CUDA GPU from Ampere on, ...) and this machine has none: "
                "leave bf16 unset (on where the hardware supports it) or pass --bf16 false; --use_cpu true trains "
                "in bf16 on the CPU."
            )
        for name in self._VALID_DICT_FIELDS:
            value = getattr(self, name, None)
            if isinstance(value, str) and value.strip().startswith("{"):
                try:
                    setattr(self, name, json.loads(value))
                except json.JSONDecodeError as error:  # json's message names no field (a Python dict's quotes)
                    example = DICT_FIELD_EXAMPLES.get(name, '{"key": "value"}')
                    raise ValueError(
                        f"{name} is not JSON ({error}): JSON quotes with \", e.g. {name}='{example}'"
                    ) from None
        for name, example in DICT_FIELD_EXAMPLES.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):  # read later as a mapping: a TypeError mid-setup
                raise ValueError(f"{name} must be a dict or a JSON object, got {value!r}: e.g. {name}='{example}'")
        # One value where a list is expected (a YAML scalar): a name's characters were names, a number not iterable.
        if isinstance(self.positive_reward_funcs, str):
            self.positive_reward_funcs = [self.positive_reward_funcs]
        self.reward_weights = number_list(self.reward_weights, "reward_weights")
        self.model_init_kwargs = with_dtype_named(self.model_init_kwargs)
        # GRPOTrainer loads the policy with `model_init_kwargs`' `trust_remote_code` where it is set there (over its
        # field). Every other load here reads the field (the critic's own classifier class, a loaded model's
        # tokenizer, vLLM's engine): True there sets it, so that the field says what the policy was loaded with.
        asked = (self.model_init_kwargs or {}).get("trust_remote_code")
        if asked is not None and bool(asked) != self.trust_remote_code:
            if not asked:
                raise ValueError(
                    "model_init_kwargs['trust_remote_code'] is False and trust_remote_code is True: say it once, "
                    "with trust_remote_code (the policy, its critic, its tokenizer and vLLM all read it)."
                )
            self.trust_remote_code = True

    def check_again(self) -> None:
        """The sizes derived and the checks made at construction, again, for the fields set since (transformers'
        TrainingArguments are set so: `args.gradient_accumulation_steps = 4`, where the rollout size derived from the
        old value planned a run of 0 steps, and `args.num_generations = 16` failed once the models had loaded). A
        derived size follows its fields again; a given one stays, and a DeepSpeed config's "auto" values are filled
        again (DeepSpeed accumulated over the old gradient_accumulation_steps). The trainer calls it before anything
        loads."""
        self.__dict__["_initialized"] = False  # (what is derived here stays marked `Derived`: see __setattr__)
        try:
            self._check_number_fields()
            self._settings_as_given()
            self._accept_grpo_spellings()
            self.report_to = _reporting_integrations(self.report_to)
            self._derive_defaults()
            self._resolve_batch_sizes()
            if self.deepspeed:  # its "auto" values, filled from the fields as they were built (transformers' step 12)
                from accelerate.utils import DeepSpeedPlugin
                from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

                self.hf_deepspeed_config = HfTrainerDeepSpeedConfig(self.deepspeed)
                self.hf_deepspeed_config.trainer_config_process(self)
                self.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=self.hf_deepspeed_config)
            self._validate_warning_once()
        finally:
            self.__dict__["_initialized"] = True

    def _validate_warning_once(self) -> None:
        """`_validate`, each of its warnings given once by this config (`check_again` validates it a second time)."""
        warned, caught = self.__dict__.setdefault("_warned", set()), []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self._validate()
        finally:
            where = _user_frame()
            for warning in caught:
                if str(warning.message) not in warned:
                    warned.add(str(warning.message))
                    warnings.warn_explicit(warning.message, warning.category, where.f_code.co_filename, where.f_lineno)

    def to_dict(self) -> dict[str, Any]:
        """transformers' serialisation (a `*_token` field's value hidden), with a credential inside a dict field hidden
        as well: `model_init_kwargs={"token": "hf_..."}` (a gated base) was written verbatim to `vapo_config.json` in
        every checkpoint and saved model, pushed to the Hub with them, and sent to the trackers' run config."""
        return {name: _credentials_hidden(plain(value)) for name, value in super().to_dict().items()}

    def _check_number_fields(self) -> None:
        """A clear error for a number field holding what is not its number (a YAML `null` or `8.0`, a string through
        the Python API: `check_number_fields`) and for a schedule VAPO does not run, both before transformers' own
        setup reads them."""
        check_number_fields(self)
        schedule = str(getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type))
        if schedule not in _LR_SCHEDULES:  # before transformers', which lists schedules VAPO then refuses
            raise ValueError(f"lr_scheduler_type must be one of {', '.join(_LR_SCHEDULES)}; got {schedule!r}.")

    def _uses_fsdp(self) -> bool:
        """FSDP asked for here (`fsdp`) or by `accelerate launch` (its environment)."""
        return bool(self.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")

    def _accept_grpo_spellings(self) -> None:
        """GRPOConfig's names for VAPO's settings, resolved as GRPOConfig resolves them."""
        grpo_loss = self.loss_type in GRPO_SURROGATE_LOSS_TYPES or self.loss_type in GRPO_LOSS_TYPES
        if isinstance(self.surrogate, Derived) and grpo_loss and not isinstance(self.loss_type, Derived):
            # The surrogate an earlier GRPO loss_type set (`loss_type="cispo"`) follows the GRPO loss_type set since
            # ("sapo", "dapo"), as it would have at construction; VAPO's aggregations ("token", "sequence", "luspo")
            # keep it.
            self.__dict__["surrogate"] = "ppo"
        if self.loss_type in GRPO_SURROGATE_LOSS_TYPES:
            surrogate, aggregation = GRPO_SURROGATE_LOSS_TYPES[self.loss_type]
            if self.surrogate not in ("ppo", surrogate):
                raise ValueError(
                    f"loss_type={self.loss_type!r} sets surrogate={surrogate!r}, but surrogate={self.surrogate!r} is "
                    f"set too: keep one (surrogate={self.surrogate!r} with loss_type 'token' or 'sequence')."
                )
            named = self.surrogate == surrogate and not isinstance(self.surrogate, Derived)  # not derived
            self.__dict__["surrogate"] = surrogate if named else DerivedStr(surrogate)
            self.__dict__["loss_type"] = DerivedStr(aggregation)
        self.loss_type = GRPO_LOSS_TYPES.get(self.loss_type, self.loss_type)
        scale = self.scale_rewards
        if isinstance(scale, str) and scale.lower() in ("true", "false"):  # TRL's booleans as the command line's text
            scale = scale.lower() == "true"
        self.scale_rewards = {True: "group", False: "none"}.get(scale, scale)
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":  # the CLI passes a string
            text = self.pad_to_multiple_of.strip().lower()
            if text not in ("none", "null") and not text.isdigit():
                raise ValueError(
                    f"pad_to_multiple_of must be a whole number >= 1, 'auto' or None, got {self.pad_to_multiple_of!r}."
                )
            self.pad_to_multiple_of = None if text in ("none", "null") else int(text)
        if self.pad_to_multiple_of == "auto":  # Neuron compiles once per input shape: padding bounds the shapes
            self.pad_to_multiple_of = 128 if self.device.type == "neuron" else None
        if self.use_transformers_paged:
            warnings.warn(
                "`use_transformers_paged` is deprecated (as in TRL): use `use_transformers_continuous_batching`.",
                FutureWarning,
                stacklevel=3,
            )
            self.use_transformers_continuous_batching, self.use_transformers_paged = True, False  # (read)
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn(
                "`vllm_importance_sampling_cap` is deprecated (as in TRL): use `vllm_importance_sampling_clip_max`.",
                FutureWarning,
                stacklevel=3,
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
            self.vllm_importance_sampling_cap = None  # (read: a second reading, `check_again`'s, warned again)
        if self.use_liger_kernel:  # as GRPOTrainer (TRL 1.16): Liger's layer kernels only, the LM head stays ours
            # (its deprecation is warned in `_validate`, once a config)
            if not (self.liger_kernel_config or {}).get("fused_linear_cross_entropy"):
                self.liger_kernel_config = {**(self.liger_kernel_config or {}), "fused_linear_cross_entropy": False}

    def _refused_grpo_settings(self) -> list[str]:
        """GRPOConfig settings this config asks for that VAPO does not have, each with what VAPO does instead."""
        refused = []
        for name, (default, instead, *also) in GRPO_ONLY.items():
            value = getattr(self, name)
            accepted = (default, *also[0]) if also else (default,)
            if not any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in accepted):
                refused.append(f"{name}={value!r}: {instead}")
        if self.use_liger_kernel and (self.liger_kernel_config or {}).get("fused_linear_cross_entropy"):
            refused.append(
                'liger_kernel_config={"fused_linear_cross_entropy": True}: it replaces the model\'s forward; VAPO '
                "computes the LM head's log-probabilities with its own tiled kernel (no [B, T, V] logits)."
            )
        return refused

    def _resolve_batch_sizes(self) -> None:
        # The one of the two derived from the other before (a copy's, `Derived`) is derived again, from this config's
        # sizes: a copy with another batch size or accumulation failed with the old rollout size.
        self.generation_batch_size = given(self.generation_batch_size)
        self.steps_per_generation = given(self.steps_per_generation)
        sizes = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
        for name in (*sizes, "generation_batch_size", "steps_per_generation"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}.")
        per_step = self.per_device_train_batch_size * self.world_size
        both = self.generation_batch_size is not None and self.steps_per_generation is not None
        if both and self.generation_batch_size != per_step * self.steps_per_generation:
            # Both agreeing is a config read back (`to_dict`, a saved run's args); GRPOConfig refuses even that.
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size}) and steps_per_generation "
                f"({self.steps_per_generation}) disagree: a rollout is per_device_train_batch_size * num_processes "
                f"({per_step}) * steps_per_generation completions. Set only one of them; the other follows."
            )
        if both:
            self.generation_batch_size = None  # resolved from steps_per_generation below, as given
        self._rollout_size_set = self.generation_batch_size is not None  # which of the two fields errors name
        if self.generation_batch_size is not None:
            if self.generation_batch_size % per_step != 0:
                raise ValueError(
                    f"generation_batch_size ({self.generation_batch_size}) must be a multiple of "
                    f"per_device_train_batch_size * num_processes ({per_step})."
                )
            self.steps_per_generation = DerivedInt(self.generation_batch_size // per_step)
        else:
            if self.steps_per_generation is None:
                self.steps_per_generation = DerivedInt(self.gradient_accumulation_steps)
            self.generation_batch_size = DerivedInt(per_step * self.steps_per_generation)

    def _validate(self) -> None:
        def require(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(message)

        if self.use_liger_kernel:  # (as GRPOTrainer, TRL 1.16)
            warnings.warn(
                "`use_liger_kernel=True` is deprecated and will be removed in v2.0.0. Use the Hub kernels instead, "
                'with `model_init_kwargs={"use_kernels": True}`.',
                FutureWarning,
                stacklevel=2,
            )
        # (transformers makes it as the Trainer is built, once the models have loaded: FileExistsError)
        with contextlib.suppress(OSError):  # (a folder not searchable: transformers' error, as before)
            require(
                self.output_dir is None or not Path(self.output_dir).exists() or Path(self.output_dir).is_dir(),
                f"output_dir {self.output_dir} is a file: name a folder (it holds the checkpoints and the trained "
                "model).",
            )
        require(self.num_generations >= 1, f"num_generations must be >= 1, got {self.num_generations}.")
        require(
            self.generation_batch_size % self.num_generations == 0,
            f"generation_batch_size ({self.generation_batch_size} = per_device_train_batch_size "
            f"{self.per_device_train_batch_size} x {self.world_size} process(es) x steps_per_generation "
            f"{self.steps_per_generation}) must be a multiple of num_generations ({self.num_generations}). "
            f"Valid num_generations: {_divisors(self.generation_batch_size)}.",
        )
        steps, accumulation = self.steps_per_generation, self.gradient_accumulation_steps
        below = steps // accumulation * accumulation
        divisors = " or ".join(map(str, _nearest_divisors(steps, accumulation)))
        if self._rollout_size_set:  # the field the user set, in its own unit (completions)
            per_step = self.per_device_train_batch_size * self.world_size
            what = (
                f"generation_batch_size ({self.generation_batch_size}) must be a multiple of "
                f"per_device_train_batch_size x processes x gradient_accumulation_steps ({per_step * accumulation})"
            )
            field, unit = "generation_batch_size", per_step
        else:
            what = f"steps_per_generation ({steps}) must be a multiple of gradient_accumulation_steps ({accumulation})"
            field, unit = "steps_per_generation", 1
        multiples = " or ".join(str(m * unit) for m in (below, below + accumulation) if m)
        require(
            steps % accumulation == 0,
            f"{what}: a rollout is split into whole optimizer steps, so that every step's token mean spans as many "
            f"completions (GRPO lets a step span two rollouts). Nearest valid: {field}={multiples}; or "
            f"gradient_accumulation_steps={divisors}.",
        )
        refused = self._refused_grpo_settings()
        require(
            not refused,
            "VAPOConfig accepts GRPOConfig's fields, but these settings ask for GRPO features VAPO does not have:\n"
            + "\n".join(f"  - {line}" for line in refused)
            + "\nRemove them (or set them back to GRPO's defaults) to train with VAPO's objective.",
        )
        require(
            self.loss_type in ("token", "sequence", "luspo"),
            f"loss_type must be 'token', 'sequence' or 'luspo' (or GRPOConfig's "
            f"{', '.join(map(repr, [*GRPO_LOSS_TYPES, *GRPO_SURROGATE_LOSS_TYPES]))}), got {self.loss_type!r}.",
        )
        require(
            self.surrogate in SURROGATES,
            f"surrogate must be one of {', '.join(map(repr, SURROGATES))}, got {self.surrogate!r}.",
        )
        require(
            self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0,
            f"sapo_temperature_pos and sapo_temperature_neg must be > 0, got {self.sapo_temperature_pos} and "
            f"{self.sapo_temperature_neg}.",
        )
        require(
            self.surrogate != "vespo"
            or not (self.use_vllm and self.vllm_importance_sampling_correction)
            or self.vllm_importance_sampling_mode in ("token_truncate", "token_mask"),
            f"surrogate='vespo' takes vLLM's per-token importance ratios into its sequence weight: it needs "
            f"vllm_importance_sampling_mode 'token_truncate' or 'token_mask', got "
            f"{self.vllm_importance_sampling_mode!r}.",
        )
        require(
            self.save_strategy != "best" or (self.metric_for_best_model and self.eval_strategy != "no"),
            "save_strategy='best' writes a checkpoint when metric_for_best_model improves at an evaluation: set "
            "metric_for_best_model (e.g. 'reward', 'accuracy') and eval_strategy ('steps' or 'epoch', with an "
            "eval_dataset); without them no checkpoint would ever be written.",
        )
        if self.use_vllm:  # vLLM refuses these only once it starts, after the policy has loaded
            require(
                self.vllm_tensor_parallel_size >= 1,
                f"vllm_tensor_parallel_size must be >= 1, got {self.vllm_tensor_parallel_size}.",
            )
            require(  # (TRL checks it when the engine starts: after every model has loaded)
                self.vllm_mode != "colocate" or self.world_size % self.vllm_tensor_parallel_size == 0,
                f"vllm_tensor_parallel_size ({self.vllm_tensor_parallel_size}) must divide the number of processes "
                f"({self.world_size}): colocated, each group of that many processes shares one vLLM engine. Launch a "
                f"multiple of {self.vllm_tensor_parallel_size} processes (accelerate launch --num_processes), or "
                "lower vllm_tensor_parallel_size.",
            )
            require(
                0 < self.vllm_gpu_memory_utilization <= 1,
                f"vllm_gpu_memory_utilization is a share of the GPU's memory, in (0, 1]; got "
                f"{self.vllm_gpu_memory_utilization}.",
            )
            shortest = (self.max_prompt_length or 1) + self.max_completion_length
            require(
                self.vllm_max_model_length is None or self.vllm_max_model_length >= shortest,
                f"vllm_max_model_length ({self.vllm_max_model_length}) is shorter than a prompt "
                f"({'max_prompt_length ' + str(self.max_prompt_length) if self.max_prompt_length else 'one token'}) "
                f"plus max_completion_length ({self.max_completion_length}): vLLM would cut completions short.",
            )
        require(
            not self.remove_unused_columns,
            "remove_unused_columns=True is not supported: the reward functions receive every column of the data set "
            "(the gold answer), as GRPOTrainer's default False does. Leave it False.",
        )
        require(
            not self.save_on_each_node,
            "save_on_each_node=True is not supported: checkpoints are written into output_dir by the main process "
            "and each process's random-number state beside them, so every node needs the same output_dir (a shared "
            "file system). Leave it False.",
        )
        require(
            self.num_generations_eval is None or self.num_generations_eval >= 1,
            f"num_generations_eval must be >= 1 or None, got {self.num_generations_eval}.",
        )
        require(
            self.pad_to_multiple_of is None
            or (isinstance(self.pad_to_multiple_of, int) and not isinstance(self.pad_to_multiple_of, bool))
            and self.pad_to_multiple_of >= 1,
            f"pad_to_multiple_of must be a whole number >= 1, 'auto' or None, got {self.pad_to_multiple_of!r}.",
        )
        require(
            self.cache_implementation is None or not (self.use_vllm or self.use_transformers_continuous_batching),
            f"cache_implementation={self.cache_implementation!r} sets model.generate()'s KV cache; vLLM and "
            "continuous batching keep their own (paged) cache. Remove it, or generate with model.generate().",
        )
        generation = self.generation_kwargs or {}
        owned = generation_kwargs_problem(generation)
        require(owned is None, owned or "")
        evaluates = self.eval_strategy != "no" or self.eval_on_start
        evaluated_copies = (self.num_generations_eval or self.num_generations) if evaluates else 1
        if self.use_vllm and self.vllm_mode == "colocate":
            seeded = colocated_vllm_seed_problem(generation, max(self.num_generations, evaluated_copies))
            require(seeded is None, seeded or "")
        require(
            not (
                self.use_vllm
                and self.vllm_mode == "server"
                and max(self.num_generations, evaluated_copies) > 1
                and generation.get("do_sample") is False
            ),
            "Greedy sampling (do_sample=False) with a vLLM server and num_generations > 1 (or num_generations_eval, "
            "with evaluation): vLLM refuses n > 1 under greedy sampling ('n must be 1 when using greedy sampling'), "
            "at every rollout or evaluation; the copies would be identical anyway. Sample: drop do_sample=False from "
            "generation_kwargs, or set num_generations=1 and num_generations_eval=1.",
        )
        require(
            self.ds3_gather_for_generation or not self.use_vllm,
            "ds3_gather_for_generation=False cannot be used with use_vllm=True: vLLM needs the policy's whole "
            "weights (as in TRL).",
        )
        scheduler_kwargs = dict(self.lr_scheduler_kwargs or {})
        schedule = str(getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type))
        taken = {"num_cycles"} if schedule == "cosine" else set()
        require(
            set(scheduler_kwargs) <= taken,
            f"lr_scheduler_kwargs={scheduler_kwargs} is not taken by lr_scheduler_type={schedule!r}: "
            f"{'cosine takes num_cycles only' if taken else 'it takes none'} (the schedules are "
            "trl_vapo.optim.Schedule's, one per side).",
        )
        optim = str(getattr(self.optim, "value", self.optim))
        why = next((why for prefix, why in _OPTIMIZERS_REFUSED if prefix in optim), None)
        require(
            why is None,
            f"optim={optim!r} is not supported: VAPOTrainer builds the actor's and the critic's parameter groups "
            f"itself and clips and steps them separately, and {why}. Use an AdamW (adamw_torch, adamw_torch_fused, "
            "adamw_8bit, paged_adamw_8bit, ...), adafactor, sgd, rmsprop or a Lion.",
        )
        if why is None:  # its package, its `optim_args`: asked now, not when `train()` builds it after the models load
            try:
                Trainer.get_optimizer_cls_and_kwargs(self)
            except (ImportError, ValueError) as error:
                require(False, f"optim={optim!r} cannot be built here: {' '.join(str(error).split())}")
        require(
            0 <= self.epsilon < 1 and self.epsilon_high >= 0,
            f"epsilon must be in [0, 1) (the ratio's lower bound is 1 - epsilon) and epsilon_high >= 0, got "
            f"{self.epsilon} and {self.epsilon_high}.",
        )
        for name in ("lam_actor", "lam_critic", "gamma"):
            value = getattr(self, name)
            require(0.0 <= value <= 1.0, f"{name} must be in [0, 1], got {value}.")
        require(
            self.length_adaptive_alpha is None or self.length_adaptive_alpha > 0,
            f"length_adaptive_alpha must be > 0 (or None to turn length-adaptive GAE off), got "
            f"{self.length_adaptive_alpha}.",
        )
        require(self.nll_coef >= 0, f"nll_coef must be >= 0, got {self.nll_coef}.")
        require(self.entropy_coef >= 0, f"entropy_coef must be >= 0 (0: no entropy bonus), got {self.entropy_coef}.")
        require(
            self.multi_objective_aggregation in ("sum_then_normalize", "normalize_then_sum"),
            f"multi_objective_aggregation must be 'sum_then_normalize' or 'normalize_then_sum', got "
            f"{self.multi_objective_aggregation!r}.",
        )
        require(
            self.multi_objective_aggregation != "normalize_then_sum"
            or min(self.num_generations, self.num_generations_eval or self.num_generations) >= 2,
            "multi_objective_aggregation='normalize_then_sum' standardises each function's scores within a prompt's "
            f"group, which needs num_generations >= 2 and num_generations_eval >= 2 or unset (got "
            f"{self.num_generations} and {self.num_generations_eval}: every reward of a group of 1 would be 0).",
        )
        require(
            not self.drop_long_prompts or self.max_prompt_length is not None,
            "drop_long_prompts=True drops the prompts longer than max_prompt_length, which is unset (None: no prompt "
            "is cut or dropped): set max_prompt_length.",
        )
        if (
            self.length_adaptive_alpha is not None
            and self.lam_actor != type(self).__dataclass_fields__["lam_actor"].default
        ):
            warnings.warn(
                f"lam_actor={self.lam_actor} is not used: with length_adaptive_alpha={self.length_adaptive_alpha} "
                "each completion's lambda is 1 - 1/(alpha * length). Set length_adaptive_alpha=None to use lam_actor.",
                stacklevel=2,  # (given where the user's code called: `_validate_warning_once`)
            )
        require(
            0.0 <= self.top_entropy_quantile <= 1.0,
            f"top_entropy_quantile must be in [0, 1] (1: every token trains), got {self.top_entropy_quantile}.",
        )
        require(
            self.off_policy_mask_threshold is None or self.off_policy_mask_threshold >= 0,
            f"off_policy_mask_threshold must be >= 0 (a KL estimate) or None (off), got "
            f"{self.off_policy_mask_threshold}.",
        )
        if self.use_adaptive_entropy:
            require(
                0 <= self.entropy_coef_min <= self.entropy_coef_max and self.entropy_coef_delta >= 0,
                f"use_adaptive_entropy needs 0 <= entropy_coef_min <= entropy_coef_max and entropy_coef_delta >= 0, "
                f"got {self.entropy_coef_min}, {self.entropy_coef_max} and {self.entropy_coef_delta}.",
            )
        require(
            not self.sync_ref_model or self.beta > 0,
            "You passed `sync_ref_model=True` while `beta=0.0`, which means the reference model is not used during "
            "training, and there is nothing to synchronize. Please set `sync_ref_model=False`, or set `beta` to a "
            "non-zero value.",
        )
        require(
            0 <= self.ref_model_mixup_alpha <= 1 and self.ref_model_sync_steps >= 1,
            f"ref_model_mixup_alpha must be in [0, 1] and ref_model_sync_steps >= 1, got {self.ref_model_mixup_alpha} "
            f"and {self.ref_model_sync_steps}.",
        )
        require(
            self.importance_sampling_level in ("token", "sequence"),
            f"importance_sampling_level must be 'token' or 'sequence' (GSPO), got {self.importance_sampling_level!r}.",
        )
        require(  # CISPO, SAPO and VESPO have no clipped ratio to cap: GRPOTrainer ignores delta for them, as VAPO
            self.delta is None or self.surrogate != "ppo" or self.delta > 1 + self.epsilon_high,
            f"delta must be > 1 + epsilon_high = {1 + self.epsilon_high} (it caps the ratio of negative advantages; "
            f"lower, it would clip positive ones too), got {self.delta}. epsilon_high defaults to VAPO's clip-higher "
            "0.28 (GRPOConfig's default is epsilon): set it to epsilon for GRPO's symmetric clipping.",
        )
        require(
            self.router_aux_loss_coef is None or self.router_aux_loss_coef >= 0,
            f"router_aux_loss_coef must be >= 0 (None: the model's own), got {self.router_aux_loss_coef}.",
        )
        require(self.beta >= 0, f"beta must be >= 0, got {self.beta}.")
        unknown, uninstalled = _unusable_trackers(self.report_to)
        require(
            not unknown,
            f"report_to names {', '.join(map(repr, unknown))}, which transformers does not know: use one of "
            f"{', '.join(_trackers())}, 'all' (those installed) or 'none'.",
        )
        require(
            not uninstalled,
            f"report_to names {', '.join(uninstalled)}, not installed here: `pip install "
            f"{' '.join(_TRACKER_PACKAGES.get(n, n) for n in uninstalled)}`, or set report_to to 'none'.",
        )
        require(self.vf_coef > 0, f"vf_coef must be > 0, got {self.vf_coef}.")
        # The fields a user sets, each named: a derived one's error would send them to a field they never set.
        require(self.learning_rate >= 0, f"learning_rate must be >= 0, got {self.learning_rate}.")
        require(
            self.critic_learning_rate > 0,
            f"critic_learning_rate must be > 0, got {self.critic_learning_rate}"
            + (
                f" (2 x learning_rate={self.learning_rate}, its default)."
                if isinstance(self.critic_learning_rate, Derived)
                else "."
            ),
        )
        require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}.")
        require(
            self.max_grad_norm is None or self.max_grad_norm >= 0,
            f"max_grad_norm must be >= 0, got {self.max_grad_norm}.",
        )
        require(
            self.max_completion_length >= 1, f"max_completion_length must be >= 1, got {self.max_completion_length}."
        )
        require(
            self.max_prompt_length is None or self.max_prompt_length >= 1,
            f"max_prompt_length must be >= 1 or None, got {self.max_prompt_length}.",
        )
        require(self.top_k is None or self.top_k >= 0, f"top_k must be >= 0 (0: off), got {self.top_k}.")
        require(
            self.repetition_penalty > 0, f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty}."
        )
        require(
            self.cliprange_value is None or self.cliprange_value > 0,
            f"cliprange_value must be > 0 or None, got {self.cliprange_value}.",
        )
        require(self.num_iterations >= 1, f"num_iterations must be >= 1, got {self.num_iterations}.")
        require(
            self.critic_num_iterations >= self.num_iterations,
            f"critic_num_iterations ({self.critic_num_iterations}) must be at least num_iterations "
            f"({self.num_iterations}): the critic trains on every pass the policy does.",
        )
        require(
            self.value_pretrain_num_iterations >= 1,
            f"value_pretrain_num_iterations must be >= 1 or None, got {self.value_pretrain_num_iterations}.",
        )
        require(
            self.value_pretrain_replay >= 0, f"value_pretrain_replay must be >= 0, got {self.value_pretrain_replay}."
        )
        require(self.value_pretrain_steps >= 0, f"value_pretrain_steps must be >= 0, got {self.value_pretrain_steps}.")
        require(
            self.value_pretrain_patience is None or self.value_pretrain_patience >= 1,
            f"value_pretrain_patience must be >= 1 or None, got {self.value_pretrain_patience}.",
        )
        require(self.temperature > 0, f"temperature must be > 0, got {self.temperature}.")
        require(
            self.nonfinite_loss_patience >= 1,
            f"nonfinite_loss_patience must be >= 1, got {self.nonfinite_loss_patience}.",
        )
        require(
            self.max_steps == -1 or self.max_steps > 0,
            f"max_steps must be a positive number of RL optimizer steps (or -1 to use num_train_epochs), got "
            f"{self.max_steps}.",
        )
        require(
            0 < self.num_train_epochs < math.inf,  # inf: an OverflowError as the run was planned, the model loaded
            f"num_train_epochs must be > 0 and finite, got {self.num_train_epochs}.",
        )
        require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}.")
        for name in ("logging_steps", "save_steps", "eval_steps"):  # (below 1, a share of max_steps to transformers:
            value = getattr(self, name)  # a negative one logged, saved or evaluated at the last step alone, silently)
            require(
                value is None or value > 0,
                f"{name} must be > 0 (a number of steps, or a share of max_steps in (0, 1)), got {value}.",
            )
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}.")
        require(self.min_p is None or 0 <= self.min_p <= 1, f"min_p must be in [0, 1] or None, got {self.min_p}.")
        require(
            self.diagnostic_position_buckets >= 1,
            f"diagnostic_position_buckets must be >= 1, got {self.diagnostic_position_buckets}.",
        )
        require(
            self.vllm_importance_sampling_mode in IMPORTANCE_SAMPLING_MODES,
            f"vllm_importance_sampling_mode must be one of {', '.join(IMPORTANCE_SAMPLING_MODES)}, got "
            f"{self.vllm_importance_sampling_mode!r}.",
        )
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        require(
            (low is None or low >= 0) and (high is None or high > 0),
            f"vllm_importance_sampling_clip_min must be >= 0 and vllm_importance_sampling_clip_max > 0 (bounds of a "
            f"ratio of probabilities), got {low} and {high}.",
        )
        require(
            low is None or high is None or low < high,
            f"vllm_importance_sampling_clip_min ({low}) must be below vllm_importance_sampling_clip_max ({high}).",
        )
        require(  # (GRPOConfig's condition: with the correction off, the mode is never read)
            not self.vllm_importance_sampling_correction
            or not self.vllm_importance_sampling_mode.endswith("truncate")
            or low is not None
            or high is not None,
            f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} needs "
            "vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max.",
        )
        require(
            self.reward_weights is None or all(math.isfinite(w) for w in self.reward_weights),
            f"reward_weights must be finite numbers, got {self.reward_weights}: a NaN or infinite weight makes every "
            "reward NaN or infinite.",
        )
        require(
            self.positive_reward_funcs is None or len(self.positive_reward_funcs) > 0,
            "positive_reward_funcs=[] names no function, so no completion would ever be correct (the NLL loss and "
            "`accuracy` would read 0): name the functions that judge correctness, or leave it None (all of them).",
        )
        # DDP's setting: several processes (as launched: torchrun, accelerate launch), neither DeepSpeed nor FSDP
        ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not uses_deepspeed(self) and not self._uses_fsdp()
        critic_only_passes = self.value_pretrain_steps > 0 or self.critic_num_iterations > self.num_iterations
        require(
            not ddp or self.ddp_find_unused_parameters is not False or not critic_only_passes,
            "ddp_find_unused_parameters=False on several processes: value pretraining and the critic's extra "
            "passes (critic_num_iterations > num_iterations) leave the policy out of the forward pass, which DDP "
            "then refuses at the next step ('Expected to have finished reduction in the prior iteration'). Leave it "
            "unset (VAPO then turns it on for the run), or set value_pretrain_steps=0 (a frozen value function or a "
            "pretrained critic skips the phase anyway) and no extra critic passes.",
        )
        reentrant = self.gradient_checkpointing and (self.gradient_checkpointing_kwargs or {}).get("use_reentrant")
        require(
            not ddp or not reentrant or self.ddp_find_unused_parameters is False,
            "gradient_checkpointing_kwargs={'use_reentrant': True} on several processes: VAPO's DDP finds unused "
            "parameters (a step may leave the policy or the critic out of the forward pass), which reentrant "
            "checkpointing cannot run with (DDP raises at the first backward: a parameter 'marked as ready twice'). "
            "Use use_reentrant=False (the default).",
        )
        if ddp and self.ddp_static_graph:
            static_graph_breaks = []
            if critic_only_passes:
                static_graph_breaks.append(
                    "DDP's static graph holds only where every step uses the same parameters, and value pretraining "
                    "and the critic's extra passes (critic_num_iterations > num_iterations) leave the policy out of "
                    "the forward pass: set value_pretrain_steps=0 (a frozen value function or a pretrained critic "
                    "skips the phase anyway) and no extra critic passes"
                )
            if self.gradient_accumulation_steps > 1:
                static_graph_breaks.append(
                    f"gradient_accumulation_steps={self.gradient_accumulation_steps} accumulates under `no_sync`, "
                    "where PyTorch's static-graph DDP fails its first backward ('expect_autograd_hooks_ INTERNAL "
                    "ASSERT FAILED', pytorch/pytorch#143580): set gradient_accumulation_steps=1 (a larger "
                    "per_device_train_batch_size)"
                )
            require(
                not static_graph_breaks,
                "ddp_static_graph=True on several processes: " + "; and ".join(static_graph_breaks) + ". Or leave "
                "ddp_static_graph unset.",
            )
        # transformers' Trainer reads these in its DataLoaders and its accelerator, after VAPO has planned its steps.
        accelerator_config = self.accelerator_config
        accumulation = getattr(accelerator_config, "gradient_accumulation_kwargs", None) or {}
        require(
            "num_steps" not in accumulation,
            f"accelerator_config's gradient_accumulation_kwargs sets num_steps={accumulation.get('num_steps')}: "
            "transformers copies it into gradient_accumulation_steps once the trainer is built, after VAPO has "
            "planned its steps from gradient_accumulation_steps (the run trained no step, or each with one "
            "micro-batch). Set "
            f"gradient_accumulation_steps={accumulation.get('num_steps')} instead.",
        )
        require(
            not getattr(accelerator_config, "split_batches", False),
            "accelerator_config's split_batches=True is not supported: it splits a DataLoader's batches over the "
            "processes, and VAPO has none (each process takes per_device_train_batch_size rows of a rollout). Divide "
            "the batch by the number of processes in per_device_train_batch_size instead.",
        )
        require(
            not self.auto_find_batch_size,
            "auto_find_batch_size=True is not supported (nor by GRPO): a rollout must hold whole groups of "
            "num_generations completions, and halving the batch on out-of-memory breaks that. Lower "
            "per_device_train_batch_size instead (gradient_accumulation_steps keeps the batch).",
        )
        parallel = self.parallelism_config
        require(
            parallel is None or not (getattr(parallel, "cp_enabled", False) or getattr(parallel, "sp_enabled", False)),
            "parallelism_config with cp_size > 1 or sp_size > 1 (sequence parallelism) is not supported (nor by "
            "GRPO): the model inputs are built after generation, where transformers' input sharding does not apply. "
            "Set cp_size=1 and sp_size=1, or leave parallelism_config unset.",
        )
        require(
            self.neftune_noise_alpha is None,
            f"neftune_noise_alpha={self.neftune_noise_alpha} is not supported: NEFTune's noise on the embeddings in "
            "the updates would make the policy's log-probs differ from those of the policy that sampled (the PPO "
            "ratio and the KL would read the noise). Leave it unset.",
        )
        require(
            not getattr(self, "enable_jit_checkpoint", False),
            "enable_jit_checkpoint=True is not supported: its SIGTERM handler would take the signal from "
            "VAPOTrainer's, which ends the rollout under way, writes a checkpoint that resumes exactly and stops "
            "(with exit code 143 from trl-vapo train). Leave it False.",
        )
        check_deepspeed_config(self)


# TrainingArguments fields that act inside `Trainer.train`'s loop and its DataLoaders, which VAPOTrainer replaces with
# its own (each rollout reads its prompts from the data set itself): set, they would change nothing.
_WITHOUT_EFFECT = (
    "debug",
    "skip_memory_metrics",
    "logging_nan_inf_filter",
    "ignore_data_skip",
    "bf16_full_eval",
    "fp16_full_eval",
    "eval_accumulation_steps",
    "label_smoothing_factor",
    "train_sampling_strategy",
    "dataloader_num_workers",
    "dataloader_pin_memory",
    "dataloader_prefetch_factor",
    "dataloader_persistent_workers",
    "dataloader_drop_last",
    "dataloader_in_order",
    "dataloader_multiprocessing_context",
    "length_column_name",
    "label_names",
    "prediction_loss_only",
    "batch_eval_metrics",
    "eval_do_concat_batches",
    "eval_use_gather_object",
    "average_tokens_across_devices",  # (VAPO's token-level loss counts every process's tokens: GRPO ignores it too)
)


CREDENTIAL_KEYS = frozenset(
    {"token", "hf_token", "hub_token", "use_auth_token", "auth_token", "access_token", "api_key"}
)
"""Keys of a settings dict (`model_init_kwargs`, ...) whose text value is a secret: written as `<KEY>`."""


def _credentials_hidden(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    return {
        key: f"<{key.upper()}>" if key in CREDENTIAL_KEYS and isinstance(item, str) else _credentials_hidden(item)
        for key, item in value.items()
    }


def settings_without_effect(args: VAPOConfig) -> list[str]:
    """``name=value`` of each `_WITHOUT_EFFECT` field set to other than `TrainingArguments`' default."""
    defaults = {f.name: f.default for f in fields(TrainingArguments) if f.name in _WITHOUT_EFFECT}
    defaults["dataloader_pin_memory"] &= not args.use_cpu  # transformers turns it off itself with use_cpu
    changed = [name for name in _WITHOUT_EFFECT if (getattr(args, name) or None) != (defaults[name] or None)]
    return [f"{name}={getattr(args, name)!r}" for name in changed]


# report_to's names whose `is_<name>_available` in transformers' integration_utils, or whose pip package, is
# spelled otherwise.
_TRACKER_CHECKS = {"azure_ml": "azureml", "flyte": "flytekit"}
_TRACKER_PACKAGES = {
    "azure_ml": "azureml-core",
    "flyte": "flytekit",
    "kubeflow": "kubeflow-training",
    "dagshub": "dagshub mlflow",
}


def _trackers() -> list[str]:
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    return list(INTEGRATION_TO_CALLBACK)


def _unusable_trackers(report_to: list) -> tuple[list, list[str]]:
    """The names in `report_to` (a list, as TrainingArguments leaves it) transformers has no callback for, and
    those whose package is not installed: transformers raises either only when the Trainer builds its callbacks,
    after the models have loaded."""
    from transformers.integrations import integration_utils

    def installed(name: str) -> bool:
        if name == "comet_ml":  # its `is_comet_available` also wants an API key; offline Comet logging needs none
            return importlib.util.find_spec("comet_ml") is not None
        check = getattr(integration_utils, f"is_{_TRACKER_CHECKS.get(name, name)}_available", None)
        return check is None or check()

    known = _trackers()
    unknown = [name for name in report_to if name not in known]
    return unknown, [name for name in report_to if name in known and not installed(name)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _reporting_integrations(report_to) -> list:
    """``report_to`` set after construction (one name, ``"all"``, ``"none"``, None) as the list transformers makes of
    it at construction (`TrainingArguments.__post_init__`): a name's letters were read as trackers' names."""
    if report_to in ("all", ["all"]):
        from transformers.integrations import get_available_reporting_integrations

        return get_available_reporting_integrations()
    if report_to in (None, "none", ["none"]):
        return []
    return report_to if isinstance(report_to, list) else [report_to]


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def _nearest_divisors(n: int, near: int) -> list[int]:
    """The divisors of `n` just below and just above `near` (one where only one side has any)."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    below, above = [d for d in divisors if d < near], [d for d in divisors if d > near]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


def _bf16_accelerator() -> bool:
    """Whether transformers' TrainingArguments takes `bf16=True` without `use_cpu` here (its own test)."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return is_torch_bf16_gpu_available() or is_torch_xla_available()


def _cuda_without_native_bf16() -> bool:
    import torch

    return torch.cuda.is_available() and not _cuda_supports_bf16()


DICT_FIELD_EXAMPLES = {
    "model_init_kwargs": '{"dtype": "bfloat16"}',
    "generation_kwargs": '{"stop_strings": ["</answer>"]}',
    "chat_template_kwargs": '{"enable_thinking": false}',
    "transformers_continuous_batching_config": '{"max_batch_tokens": 512}',
}
"""The fields VAPO reads as mappings, each with an example of its JSON on the command line."""


class Derived:
    """A field's value that the config derived from other fields (its default), not one it was given: a copy of the
    config derives it again (`given` reads it as None). A number still, in every computation and in JSON."""


class DerivedFloat(float, Derived):
    pass


class DerivedInt(int, Derived):
    pass


class DerivedStr(str, Derived):
    pass


def _user_frame():
    """The innermost frame outside this package (and the dataclass's generated ``__init__``): the user's call that
    built or checked a config, where its warnings point."""
    frame = sys._getframe(1)
    package = os.path.dirname(os.path.abspath(__file__))
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(package) or frame.f_code.co_filename == "<string>"
    ):
        frame = frame.f_back
    return frame


def given(value):
    """`value` as given: None where the config derived it (`Derived`)."""
    return None if isinstance(value, Derived) else value


def plain(value):
    """`value` a plain number where the config derived it (trackers keep only exact `int` and `float` as numbers)."""
    return type(value).__mro__[1](value) if isinstance(value, Derived) else value


def fp16_asked(fp16: bool) -> bool:
    """Whether the run computes in fp16: `fp16=True`, or `accelerate launch --mixed_precision fp16` (its environment
    variable, which transformers reads too)."""
    return fp16 or os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower() == "fp16"


def default_bf16(fp16: bool, use_cpu: bool) -> bool:
    """`bf16`'s default: on where a CUDA GPU computes in it natively (Ampere on), unless fp16 is asked for
    (`fp16_asked`: transformers lets bf16 override the launcher's fp16) or the run trains on the CPU (`use_cpu`,
    whatever GPU the machine has). On a GPU that only emulates bf16, off with a warning naming fp16."""
    if not fp16 and not use_cpu and _cuda_without_native_bf16():
        warnings.warn(
            "This GPU has no native bf16 (a T4, a V100: before Ampere), so bf16 mixed precision stays off "
            "(bf16=True would emulate it). fp16=True computes in fp16, which these GPUs' tensor cores run, "
            "with loss scaling; and load the model in float16 or float32 (`dtype`), not bfloat16, whose "
            "frozen weights compute emulated.",
            stacklevel=5,  # the code building the config (through _settings_as_given, __post_init__, __init__)
        )
    return not fp16 and not use_cpu and _cuda_supports_bf16()


def _cuda_supports_bf16() -> bool:
    """A CUDA GPU that computes in bf16 natively (from Ampere on). torch's own check says yes on a T4 or a V100 too,
    which emulate bf16 (their tensor cores run fp16, not bf16; no speed was measured here)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
