"""`VAPOTrainer`: the VAPO training loop on `transformers.Trainer`.

One rollout of the loop (`_train_on_rollout`), in the paper's order:

1. **sample**: the next prompts, each repeated `num_generations` times (group sampling), completed by the policy
   through the generation engine (`generate()`, continuous batching or vLLM: `trl_vapo.generation`);
2. **score**: the reward functions' verdict on each completion (`trl_vapo.scoring`), on its last token;
3. **value**: the critic's values, and the policy's log-probs before any update when the updates need them;
4. **advantage**: decoupled, length-adaptive GAE (`core.decoupled_gae`): advantages with each completion's
   `lambda_actor` (whitened over the whole batch, `whiten_advantages`), critic targets with `lam_critic` (1 during
   value pretraining);
5. **update**: `num_iterations` passes of shuffled optimizer steps on `core.vapo_loss`: the token-level clip-higher
   PPO loss plus the positive-example NLL for the policy, the value loss for the critic.

Value pretraining is the same loop with the policy frozen and only the critic's loss (`value_pretrain_num_iterations`
passes), until `value_pretrain_steps` rollouts or until explained variance stops improving. The math lives in
`trl_vapo.core`; this file orchestrates.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import signal
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from accelerate.utils.memory import clear_device_cache
from datasets import Dataset, IterableDataset
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback
from transformers.integrations.liger import apply_liger_kernel
from transformers.trainer_callback import ExportableState, ProgressCallback, TrainerState
from transformers.trainer_utils import IntervalStrategy, SaveStrategy, TrainOutput, speed_metrics
from trl import SyncRefModelCallback, is_conversational

from . import checkpoint as ckpt
from ._compat import (
    get_config_model_id,
    pad,
    prepare_frozen_model,
)
from .config import VAPOConfig, settings_without_effect
from .core import (
    compute_gae,
    decoupled_gae,
    explained_variance_plateaued,
    importance_sampling_weights,
    masked_mean,
    masked_whiten,
    terminal_rewards,
    vapo_loss,
)
from .data import (
    check_best_metric_names_an_eval_set,
    check_eval_dataset,
    check_stream_settings,
    check_streamed_rows,
    check_train_dataset,
    has_empty_text_prompt,
    left_truncated,
    long_prompts_handled,
    prepare_tokenizer,
    prompt_token_ids,
    refuse_prompts_without_tokens,
)
from .diagnostics import CriticBiasWatch, rollout_diagnostics, write_plots_if_possible
from .distributed import (
    check_distributed_setup,
    clip_deepspeed_gradients_,
    decided_on_main,
    deepspeed_local_gradients,
    deepspeed_quiet_unless_used,
    fsdp2_unsharded,
    groups_held_out,
    keep_fsdp2_outputs_as_computed,
    mark_offload_overflow,
    reset_adam_step,
    schedule_the_stepping_optimizer,
    settle_offloaded_gradients,
    unwrapped_for_generation,
    uses_deepspeed,
    whole_models_under_zero3,
)
from .evaluation import EvaluationMixin
from .generation import (
    EngineSettings,
    GenerationOutput,
    build_engine,
    check_engine_available,
    importance_sampling_metrics,
    read_rollout_func_output,
    sampling_seed,
    set_generation_ids,
    stop_token_ids,
    warn_off_policy_sampling,
)
from .grpo_fields import grpo_setting_warnings
from .grpo_objective import GRPOObjectiveMixin
from .hub import check_push_repository
from .loading import (
    add_policy_adapter,
    build_actor_critic,
    check_critic_tokenizer,
    check_critic_vocabulary,
    check_grpo_arguments,
    check_quantization,
    check_trainer_arguments,
    has_sequence_classifier,
    is_fresh_lora,
    is_saved_adapter,
    load_policy,
    names_the_policys_checkpoint,
    policy_init_kwargs,
    policy_tokenizer,
    resolve_value_model,
    router_aux_loss_coefficient,
)
from .metric_names import EVAL, EXPLAINED_VARIANCE, POSITION_CORRELATION, RL, VALUE_PRETRAIN
from .model_card import VAPO_CITATION, RunRecord, adapter_type_name
from .modeling import (
    REFERENCE_ADAPTER,
    ActorCritic,
    ValueFunction,
    cast_lm_head_to_fp32,
    check_reference_is_frozen,
    completion_micro_batches,
    disable_dropout,
    is_peft_model,
    keep_trainable_weights_in_float32,
    length_sorted,
    padding_spans,
    policy_fingerprints,
    value_function_name,
    value_target_settings,
)
from .optim import name_groups_by_side, parameter_groups, set_critic_length, side_schedules, start_actor_schedule
from .reporting import (
    NUMBERS_ONLY_TRACKERS,
    SEQUENCE_MEANS,
    STEP_EXTREMES,
    MetricsMixin,
    PhaseProgressCallback,
    averaged_metrics,
    leave_text_out_of_logs,
)
from .rollout import Rollout, concatenate_rollouts, rollout_metrics
from .run import PromptCursor, RunPlan, TrainingProgress
from .run_lock import output_dir_lock
from .scoring import (
    RewardFunc,
    RewardModel,
    RewardScorer,
    load_reward_models,
    parsed_completions,
    prompt_opens_think,
    repeated_rows,
    rows_with_fields,
)
from .signals import TrainingInterrupted, stop_on_signals

# Logs once, from the main process, however many processes train.
logger = get_logger(__name__)


RESUME = "resume with resume_from_checkpoint=True (`trl-vapo train ... --resume_from_checkpoint latest`)"


UNSCORED_ROLLOUTS_BEFORE_STOP, UNSCORED_PROMPTS_BEFORE_STOP = 3, 32
"""Rollouts, and prompts among them, of a run in which no reward scored any completion before it stops (none trains,
and nothing changes). Both: a rollout of one prompt, three of them unscored, may be chance (a reward that has no answer
for part of the data)."""


class VAPOTrainer(EvaluationMixin, MetricsMixin, GRPOObjectiveMixin, ckpt.SavingMixin, Trainer):
    """Trainer for VAPO: PPO with a value model, value pretraining, decoupled and length-adaptive GAE, token-level
    loss, clip-higher, positive-example NLL and group sampling (arXiv 2504.05118).

    Example:

    ```python
    from datasets import Dataset
    from trl_vapo import VAPOConfig, VAPOTrainer
    from trl_vapo.rewards import math_reward

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 6 x 7?"}], "answer": "42"}])
    trainer = VAPOTrainer(
        model="Qwen/Qwen2.5-0.5B-Instruct",
        reward_funcs=math_reward,
        args=VAPOConfig(output_dir="Qwen2.5-0.5B-VAPO"),
        train_dataset=dataset,
    )
    trainer.train()
    ```

    Args:
        model: the policy: a model id or local path (loaded with `AutoModelForCausalLM.from_pretrained` and
            `args.model_init_kwargs`), a `PreTrainedModel`, or a `PeftModel`.
        reward_funcs: one reward function or a list, following TRL's protocol (see `trl_vapo.scoring`): called with
            `prompts`, `completions`, `completion_ids`, `trainer_state`, `log_extra`, `log_metric` and every other
            dataset column, it returns one float per completion, or `None` (`async def` functions run concurrently).
            An entry may also be a reward model: a model id, a path or a sequence-classification model (any module
            with a transformers config: a `torch.compile`d one, a PEFT classifier), scored as GRPOTrainer scores it
            (`scoring.RewardModel`). Rewards are summed with `args.reward_weights` (each standardised within its
            prompt's group first under `args.multi_objective_aggregation="normalize_then_sum"`).
        args: a `VAPOConfig`.
        train_dataset: a `datasets.Dataset` with a `prompt` column (plain text or chat messages), or an
            `IterableDataset` (streaming; then `args.max_steps` is required), read in its order.
        eval_dataset: prompts to evaluate on, in every form `GRPOTrainer` takes (a `Dataset`, an `IterableDataset`, a
            `DatasetDict` or a dict of them: one evaluation per entry, its metrics prefixed `eval_<name>_`): during
            training as `eval_strategy` / `eval_steps` / `eval_on_start` say, or with `trainer.evaluate()` (see
            `evaluate`).
        processing_class: the tokenizer; loaded from `model` when omitted. Padding is set to the left.
        reward_processing_classes: as `GRPOTrainer`'s: the tokenizers of the reward models in `reward_funcs` (one,
            or a list with one per entry, None for functions); default: each model's own.
        quantization_config: as `GRPOTrainer`'s: a `BitsAndBytesConfig` to load `model` (an id or path) quantized,
            merged into `args.model_init_kwargs`; with `peft_config`, QLoRA.
        tools, environment_factory: `GRPOTrainer`'s, in its order; each is refused with an error that says what to do
            instead (see `check_grpo_arguments`).
        rollout_func: as `GRPOTrainer`'s (experimental there): `rollout_func(prompts, trainer)` samples the
            completions instead of the generation engine. It gets this process's prompts as the dataset holds them
            (each `num_generations` times in a row; chat templates are its to apply) and returns a dict of
            `prompt_ids`, `completion_ids` and `logprobs`, one list per prompt, and optionally `env_mask`: per
            completion token, 1 where the policy sampled it and 0 where an environment wrote it (a multi-turn
            episode's tool output). Tokens with 0 are context, not actions: no loss, and GAE steps over them. Other
            fields reach the reward functions as columns. `logprobs` correct for the sampler as vLLM's do, with
            `use_vllm` (whose weights are synced before each call), and `off_policy_mask_threshold` measures the
            sampler's drift with them, with or without vLLM. See the README's "Custom rollouts".
        value_model: (keyword only) the critic. None (default) initialises it from the policy's weights with a fresh
            scalar head (with `peft_config`: a second adapter on the policy's frozen base). Or a path / model id of a
            value model (`AutoModelForSequenceClassification`, one label; or a critic folder saved by this trainer,
            local or on the Hub: `owner/name/critic` of a pushed run), or a `PreTrainedModel`. A critic saved by
            value pretraining of the same policy skips that phase. Or a frozen value function,
            `fn(input_ids, attention_mask, completion_length) -> values [B, C]` (`trl_vapo.modeling.ValueFunction`):
            GAE reads its values and nothing of it trains (no value pretraining, no value loss;
            `critic_num_iterations` must equal `num_iterations`).
        callbacks: extra `TrainerCallback`s. One with an `on_rollout(args, state, control, rollout=..., rows=...)`
            method is also called with every rollout as built (a `trl_vapo.rollout.Rollout`: completions, scores,
            values, advantages) and its dataset rows, before the rollout's first update (where the critic trains in
            the scoring pass, `_critic_trains_while_scoring`, after its backward: the rollout is there to read).
        optimizers: `(optimizer, lr_scheduler)` to use instead of AdamW with one parameter group per side. The
            optimizer must hold the critic's parameters too, which the trainer builds: set `trainer.optimizer` after
            construction (`trainer.actor_critic.policy_parameters()`, `.critic_parameters()`); a group of one side's
            alone is named for it (`optim.name_groups_by_side`: the policy's rate is held at 0 until RL).
        peft_config: a `peft.PeftConfig` (e.g. `LoraConfig(r=16)`) to train adapters instead of all weights.
    """

    _tag_names = ["trl", "trl-vapo", "vapo"]
    _name = "VAPO"
    _paper = {
        "title": "VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning Tasks",
        "id": "2504.05118",
        "citation": VAPO_CITATION,
    }

    def __init__(
        self,
        model: str | PreTrainedModel | nn.Module,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: VAPOConfig | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_processing_classes: Any | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        quantization_config: Any | None = None,
        peft_config: Any | None = None,
        tools: list | None = None,
        rollout_func: Any | None = None,
        environment_factory: Any | None = None,
        *,
        value_model: str | PreTrainedModel | ValueFunction | None = None,
    ):
        # GRPOTrainer's parameters, in its order, so that a GRPO call binds the same way; VAPO's own are keywords.
        check_grpo_arguments(tools=tools, environment_factory=environment_factory)
        if rollout_func is not None and not callable(rollout_func):
            raise TypeError(f"rollout_func must be a callable `(prompts, trainer) -> dict`, got {rollout_func!r}.")
        self.rollout_func = rollout_func
        if args is None:
            name = model if isinstance(model, (str, os.PathLike)) else get_config_model_id(model.config)
            args = VAPOConfig(output_dir=f"{Path(str(name)).name or 'model'}-VAPO")
        if not isinstance(args, VAPOConfig):
            raise TypeError(f"args must be a VAPOConfig, got {type(args).__name__}.")
        args.check_again()  # fields set since it was built: its derived sizes follow them, and they are checked
        # GRPOTrainer's attributes, which a rollout_func written for it may read (TRL's openenv examples sample with
        # these: `trainer.temperature`, `trainer.max_completion_length`, `trainer.vllm_mode`, ...).
        self.num_generations = args.num_generations
        self.num_generations_eval = args.num_generations_eval or args.num_generations
        self.max_completion_length = args.max_completion_length
        self.chat_template_kwargs = args.chat_template_kwargs or {}
        self.temperature, self.top_p, self.top_k = args.temperature, args.top_p, args.top_k
        self.min_p, self.repetition_penalty = args.min_p, args.repetition_penalty
        self.vllm_mode, self.vllm_tensor_parallel_size = args.vllm_mode, args.vllm_tensor_parallel_size
        self.vllm_gpu_memory_utilization = args.vllm_gpu_memory_utilization
        self.mask_truncated_completions = args.mask_truncated_completions
        # A trl-vapo critic on the Hub, as the folder it was pushed from (its files are what the checks below read).
        given_value_model = value_model
        value_model = resolve_value_model(value_model, args, names_the_policys_checkpoint(value_model, model))
        check_trainer_arguments(model, args, peft_config, value_model, args.model_init_kwargs)  # before a model loads
        check_push_repository(args)
        # Everything a user can get wrong is checked before a model loads.
        model_init_kwargs = policy_init_kwargs(model, args.model_init_kwargs, quantization_config)
        engine_settings = EngineSettings.from_config(args)
        engine_settings.quantization_config = (model_init_kwargs or {}).get("quantization_config")
        # (a saved adapter loads as a PeftModel, its adapter trainable; looked up only where it matters)
        adapter = peft_config is not None or is_peft_model(model)
        if args.use_vllm and args._uses_fsdp() and (adapter or is_saved_adapter(model, model_init_kwargs)):
            raise ValueError(
                "use_vllm with a PEFT adapter under FSDP is not supported: the weight sync merges the adapter into "
                "the sharded base in place and takes it out after (TRL's path under FSDP), and in bf16 W + BA - BA is "
                "not W: each sync would move the base, which the critic's adapter and the KL reference compute on "
                "too. Under DeepSpeed ZeRO-3, DDP or on one process the merge is made on a copy; under FSDP, sample "
                "with generate() (use_vllm=False)."
            )
        check_engine_available(engine_settings, model)
        check_quantization(model_init_kwargs, peft_config, model)  # (before the reward models load, too)
        check_stream_settings(train_dataset, eval_dataset, args)  # first: TRL's order of these errors
        example = check_train_dataset(train_dataset, args)
        self._conversational = is_conversational({"prompt": example["prompt"]})
        eval_examples = check_eval_dataset(eval_dataset, args, self._conversational)
        check_best_metric_names_an_eval_set(eval_dataset, args)
        # VAPOConfig(deepspeed=...)'s, or `accelerate launch`'s with a DeepSpeed config file (TRL's zero3.yaml: its
        # plugin's, which `zero3_init_flag` makes transformers build every model partitioned under)
        zero3_config = getattr(args, "hf_deepspeed_config", None) or getattr(args.deepspeed_plugin, "dschf", None)
        if isinstance(value_model, nn.Module) and any(
            value_model is f for f in (reward_funcs if isinstance(reward_funcs, list) else [reward_funcs])
        ):
            # The paper's critic starts from the reward model; one object for both would be frozen as the reward
            # model (in place) and train nothing, or, trained, move the rewards. The critic gets a copy.
            value_model = copy.deepcopy(value_model)
        with whole_models_under_zero3(zero3_config):  # whole for the check below; placed after `Trainer.__init__`
            reward_funcs = load_reward_models(reward_funcs, reward_processing_classes, args)
        self.scorer = RewardScorer(reward_funcs, args.reward_weights, self._conversational, args.positive_reward_funcs)
        self.scorer.check_threshold_reachable(args.positive_reward_threshold)
        if args.positive_reward_funcs is None and len(self.scorer.names) > 1 and args.nll_coef > 0:
            # The verifiers among them (`math_reward`'s kind, which reads gold answers), else the first function.
            funcs = zip(self.scorer.funcs, self.scorer.names)
            verifiers = [name for func, name in funcs if hasattr(func, "answer_columns")]
            logger.warning(
                f"Positive examples (the NLL loss imitates them; `accuracy` counts them) are read from the weighted "
                f"sum of all {len(self.scorer.names)} reward functions ({', '.join(self.scorer.names)}): a wrong "
                "answer that another function rewards (a format reward) can count as correct. Name the functions "
                f"that judge correctness: positive_reward_funcs={verifiers or self.scorer.names[:1]}"
                + ("." if verifiers else " (if it is the verifier).")
            )
        if rollout_func is None:  # its fields are columns too, which no dataset row shows
            self.scorer.check(example, args.num_generations, args.max_steps)
            for eval_example in eval_examples.values():  # the rewards read the eval rows' columns too
                self.scorer.check(eval_example, args.num_generations_eval or args.num_generations, args.max_steps)
        self.reward_funcs, self.reward_func_names = self.scorer.funcs, self.scorer.names
        # GRPOTrainer's attribute: each reward model's tokenizer (given or its own), None for the functions.
        self.reward_processing_classes = [getattr(f, "tokenizer", None) for f in self.reward_funcs]
        self._metrics: dict[str, list[float]] = defaultdict(list)

        if processing_class is not None:  # what it cannot serve (chat prompts without a template) before any load
            prepare_tokenizer(processing_class, self._conversational)
        set_seed(args.seed)  # PEFT initialises adapters randomly
        with whole_models_under_zero3(zero3_config):
            policy, model_id = load_policy(model, args, model_init_kwargs)
        if args.use_liger_kernel:
            # Liger's layer kernels (RMSNorm, RoPE, SwiGLU, ...), as GRPOTrainer applies them (`Trainer.train`), on the
            # loaded policy before its adapter and its critic are built from it; not its fused cross-entropy, which
            # would replace the forward that VAPO's tiled LM head runs (VAPOConfig refuses it).
            apply_liger_kernel(policy, args.liger_kernel_config)
        # At the revision the policy was loaded at, as GRPOTrainer loads it (the default branch's may differ).
        by_name = isinstance(model, (str, os.PathLike))
        revision = (model_init_kwargs or {}).get("revision") if by_name else None
        # A value_model naming the checkpoint the policy was loaded from: read where the policy was.
        policys_checkpoint = names_the_policys_checkpoint(value_model, model)
        tokenizer = processing_class or policy_tokenizer(model, model_id, args, model_init_kwargs)
        prepare_tokenizer(tokenizer, self._conversational)
        if rollout_func is None and any(map(has_empty_text_prompt, (train_dataset, eval_dataset))):
            # (a rollout_func's prompt ids are its own) One the tokenizer gives no token is refused now: the rollout
            # or the evaluation that drew it failed, the steps since the last checkpoint lost (a stream's is refused
            # as it is read, after a checkpoint).
            refuse_prompts_without_tokens([""], prompt_token_ids(tokenizer, [""], conversational=False))
        # The policy agrees with its tokenizer on the pad id, as GRPOTrainer mirrors it: a model saved without one
        # (Qwen2.5's config) warned and padded with EOS in a batched `generate()` after loading.
        policy.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        set_generation_ids(policy, pad_token_id=tokenizer.pad_token_id)
        adapter_given = is_peft_model(policy)  # a trained adapter, maybe: the base alone is not the initial policy
        # Of the initial policy as it computes: a new LoRA adapter (B is zero) computes as its base, and its random A,
        # drawn with the run's seed, would make a critic value-pretrained with another seed look like one for another
        # policy. Other adapters may start random (FourierFT, VB-LoRA, a LoRA with init_lora_weights=False).
        fresh = not adapter_given and is_fresh_lora(peft_config)
        fingerprints = policy_fingerprints(policy) if fresh else None
        policy = add_policy_adapter(policy, peft_config, revision)
        fingerprint, base_fingerprint = fingerprints or policy_fingerprints(policy)
        value_targets = value_target_settings(args, self.scorer.names)
        # Before a critic of another family loads its weights.
        check_critic_tokenizer(value_model, tokenizer, args, policys_checkpoint)
        with whole_models_under_zero3(zero3_config):
            actor_critic, critic_pretrained = build_actor_critic(
                policy, value_model, args, fingerprint, value_targets, adapter_given, policys_checkpoint
            )
        frozen = actor_critic.value_function
        separate = not actor_critic.shares_base and frozen is None  # a critic model of its own, saved as one
        if separate and value_model is not None:  # one of its own (one from the policy reads what the policy reads)
            check_critic_vocabulary(actor_critic.critic, tokenizer)
        if separate:
            # A config without a pad id (Qwen2.5's): the saved critic could not score a padded batch with
            # `from_pretrained`, which finds each row's last non-pad token through the text config, as TRL's reward
            # models do. Training reads the values at every position and needs none.
            for config in (actor_critic.critic.config, actor_critic.critic.config.get_text_config()):
                if getattr(config, "pad_token_id", None) is None:
                    config.pad_token_id = tokenizer.pad_token_id
            # The critic trains the embeddings the policy trains. One built from the policy's config after the pad id
            # was mirrored there, or a saved critic loaded back with it, takes the pad id (often the EOS: Llama 3's
            # <|eot_id|>, Qwen2.5's <|endoftext|>) as its embeddings' `padding_idx`, whose row gets no gradient.
            embeddings = actor_critic.critic.get_input_embeddings()
            if isinstance(embeddings, nn.Embedding):
                embeddings.padding_idx = getattr(actor_critic.policy.get_input_embeddings(), "padding_idx", None)
        # What the saving code and the model card know of this run.
        critic_source = None  # a critic from the policy, or none (a value function)
        if value_model is not None and frozen is None:
            is_model = isinstance(value_model, nn.Module)
            critic_source = get_config_model_id(value_model.config) if is_model else str(given_value_model)
        self.run_record = RunRecord(
            base_model=get_config_model_id(actor_critic.config),
            policy_fingerprint=fingerprint,
            base_fingerprint=base_fingerprint,
            value_targets=value_targets,
            example_prompt=example["prompt"],  # the card's quick start
            is_adapter=is_peft_model(actor_critic.policy),
            adapter_type=adapter_type_name(getattr(actor_critic.policy, "active_peft_config", None)),
            critic_shares_base=actor_critic.shares_base,
            value_function=None if frozen is None else value_function_name(frozen),
            critic_pretrained=critic_pretrained,
            critic_auto_class=not separate
            or has_sequence_classifier(actor_critic.critic.config, args.trust_remote_code),
            critic_source=critic_source,
        )
        if args.cast_lm_head_to_fp32:
            # After the critic is built and the dtypes to save in are recorded (a tied head casts the embeddings
            # too): the policy is the one loaded, whatever its head computes in.
            cast_lm_head_to_fp32(policy)
        # An MoE policy's router load-balancing loss joins the policy's loss, as in GRPOTrainer (its names).
        self.router_aux_loss_coef = router_aux_loss_coefficient(policy, args)
        self.aux_loss_enabled = self.router_aux_loss_coef != 0.0
        actor_critic.with_router_aux_loss = self.aux_loss_enabled
        actor_critic.with_entropy_grad = args.entropy_coef > 0 or args.use_adaptive_entropy
        for warning in grpo_setting_warnings(args):  # GRPOTrainer's, about its loss settings
            logger.warning(warning)
        if unused := settings_without_effect(args):
            logger.warning(
                f"{', '.join(unused)}: these TrainingArguments act in transformers' training loop and its data "
                "loaders, which VAPOTrainer replaces with its own (each rollout reads its prompts from the data set; "
                "shuffle_dataset orders them): they change nothing here."
            )
        # (accelerate's autocast: bf16 anywhere, fp16 off the CPU; DeepSpeed keeps float32 master weights itself)
        autocast = args.bf16 or (args.fp16 and args.device.type != "cpu")
        cast, left = keep_trainable_weights_in_float32(actor_critic, autocast)
        if cast:
            logger.info("Trainable weights were loaded in half precision; they are kept and updated in float32.")
        if left:
            logger.warning(
                f"{len(left)} trainable weights ({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}) were loaded "
                "in half precision beside frozen ones and train so: without autocast (bf16=False) a float32 copy "
                "would meet half-precision inputs. Updates below their resolution (about 1e-6 on weights of 0.02 in "
                "bf16) are lost: set bf16=True to keep them in float32, or load the model in float32."
            )
        # With PEFT the reference policy is the base with adapters disabled where the new adapter computes as its base
        # (peft's default LoRA: B is zero); else a frozen copy of the adapter (GRPOTrainer's "ref" adapter): one given
        # trained, or one whose initialisation moved part of the base into it (PiSSA, OLoRA: the base alone is then a
        # residual) or starts random. Without PEFT a frozen copy, only if used, of the policy as it trains (in its
        # float32 weights: it computes exactly as the policy, the first KL is 0).
        self.ref_model = (
            copy.deepcopy(policy).eval().requires_grad_(False) if args.beta > 0 and not is_peft_model(policy) else None
        )
        self._peft_reference = "base"
        if args.beta > 0 and is_peft_model(policy):
            check_reference_is_frozen(policy)
            if not fresh:
                actor_critic.add_reference_adapter()
                self._peft_reference = REFERENCE_ADAPTER
        if args.disable_dropout:  # (after the reference's adapter is added: its copy of the LoRA dropout too)
            disable_dropout(actor_critic)

        with deepspeed_quiet_unless_used(uses_deepspeed(args)):
            super().__init__(
                model=actor_critic,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=tokenizer,
                callbacks=callbacks,
                optimizers=optimizers,
            )
        check_distributed_setup(self.accelerator, args)
        keep_fsdp2_outputs_as_computed(self.accelerator)  # before any model is sharded
        # As GRPOTrainer's, `trainer.model` is the policy (its parameter names, `lm_head`, `peft_config`, what
        # callbacks get as `model`); what trains, the policy and the critic as one module, is `trainer.actor_critic`.
        self.actor_critic: ActorCritic = self.model
        self.model = self.callback_handler.model = self.actor_critic.policy
        if self.ref_model is not None:
            self.ref_model = prepare_frozen_model(self.ref_model, self.accelerator)
            if args.sync_ref_model:  # TRL's callback (ZeRO-3 gathers both models for the mix)
                self.add_callback(SyncRefModelCallback(ref_model=self.ref_model, accelerator=self.accelerator))
        for func in self.reward_funcs:
            if isinstance(func, RewardModel):  # as GRPOTrainer places its reward models
                func.model = prepare_frozen_model(func.model, self.accelerator, shard=False)
                func.device = self.accelerator.device
        self._stop_ids = stop_token_ids(tokenizer, policy, args.generation_kwargs)
        self.eos_token_ids = list(self._stop_ids)  # GRPOTrainer's name, for a rollout_func
        # The saved model stops where training's completions stopped (`generate()` or a pipeline on output_dir, as
        # the model card runs it; `trl-vapo eval` stops there): its generation config named the model's EOS ids
        # only, not a tokenizer's own (a chat model's end of turn) or `generation_kwargs`' stop tokens.
        ids = self._stop_ids
        set_generation_ids(policy, eos_token_id=ids if len(ids) > 1 else ids[0])
        sharded = self.is_deepspeed_enabled or self.is_fsdp_enabled
        self.generation_engine = build_engine(
            engine_settings.placed(self.accelerator.device.type, sharded, actor_critic.policy),
            self._generation_model,
            tokenizer,
            policy=actor_critic.policy,
            accelerator=self.accelerator,
            stop_ids=self._stop_ids,
        )
        # The model's generation_config counts where the engine applies it (`generate()`), not with vLLM, which samples
        # with the settings the config names alone (`build_engine` says which of the model's it leaves out).
        applies_model_defaults = None if args.use_vllm else policy
        warn_off_policy_sampling(
            self.generation_engine.sampling, applies_model_defaults, self._stop_ids, tokenizer.pad_token_id
        )
        # GRPOTrainer's attributes, which a rollout_func written for it may read to sample with vLLM.
        self.use_vllm = args.use_vllm
        self.vllm_generation = getattr(self.generation_engine, "vllm_generation", None)
        if args.use_vllm and args.vllm_importance_sampling_correction and self.accelerator.is_main_process:
            self.generation_engine.warn_unprocessed_server_logprobs()

        if not actor_critic.learns_values and args.value_pretrain_steps > 0:
            logger.info(
                f"value_model is a frozen value function ({value_function_name(actor_critic.value_function)}): value "
                f"pretraining (value_pretrain_steps={args.value_pretrain_steps}) is skipped."
            )
        self.progress = TrainingProgress(phase=RL if self._skips_value_pretraining else VALUE_PRETRAIN)
        self._save_pending = False
        self._evaluate_pending = False
        self._last_rollout: Rollout | None = None  # the newest rollout: the next log's completions table, and `_logs`
        self._reported_rollout: Rollout | None = None  # the one whose table was logged (once per rollout)
        self._replay: list[Rollout] = []  # value pretraining's last rollouts (`value_pretrain_replay`)
        self._rewrite_log_file = False  # `train` sets it: its first log writes `vapo_logs.jsonl` anew (`log`)
        self.models_placed = False  # by `train`: wrapped (DDP, DeepSpeed) or sharded (FSDP2, ZeRO-3)
        # What only the caller knows, for the model card: dataset_name / dataset_config / dataset_description,
        # held_out ({"before": ..., "after": ..., "description": ...}), license.
        self.model_card_info: dict[str, Any] = {}
        self.run_script_args: dict[str, Any] | None = None  # `trl-vapo train`'s data and reward flags, saved
        if self.pop_callback(ProgressCallback) is not None:  # the bar names the phase; none with disable_tqdm
            self.add_callback(PhaseProgressCallback(lambda: self.progress.phase))
        for callback in self.callback_handler.callbacks:  # they would warn about `phase` at every log
            if any(kind.__name__ in NUMBERS_ONLY_TRACKERS for kind in type(callback).__mro__):  # (DagsHub's: MLflow's)
                leave_text_out_of_logs(callback)
        self._critic_bias = CriticBiasWatch()
        said = None  # a rollout_func's prompt ids are its own: max_prompt_length does not apply to them
        if rollout_func is not None and args.drop_long_prompts:  # (it did nothing, silently)
            said = "drop_long_prompts=True drops nothing with a rollout_func, whose prompt ids are its own."
        if rollout_func is None:  # may drop prompts: the plan counts what is left
            self.train_dataset, said = long_prompts_handled(
                self.train_dataset, args, lambda rows: [len(x) for x in self._tokenize_prompts(rows, truncate=False)]
            )
        if said:
            logger.warning(said)
        # Else the first training prompt cut later (a stream's) is said; an evaluation set's first cut, always.
        self._said_long_prompts = {"training"} if said is not None else set()
        self.run_plan = self._plan()
        # What a reward function's schedule reads (`trainer_state`: global_step / max_steps) from an evaluation before
        # `train()`, or `trl-vapo train`'s held-out report: transformers' 0 raised ZeroDivisionError in it.
        self.state.max_steps = self.run_plan.planned_steps
        data_seed = args.seed if args.data_seed is None else args.data_seed  # 0 is a seed
        per_rollout = self.run_plan.prompts_per_rollout
        self._prompts = PromptCursor(self.train_dataset, per_rollout, args.shuffle_dataset, data_seed)
        # Each process samples different completions even for the same prompt (as TRL's GRPOTrainer does), but those
        # of a colocated vLLM's tensor-parallel group, which sample together (after the engine's start reseeded them).
        set_seed(sampling_seed(args, self.accelerator.process_index))

    def _write_plots(self) -> None:
        """The diagnostic PNGs in `output_dir/plots/` (`trl_vapo.diagnostics`), when asked for."""
        if self.args.plot_diagnostics and self.accelerator.is_main_process:
            write_plots_if_possible(self.args.output_dir, self.state.log_history)

    # ------------------------------------------------------------------------------------------------ setup
    @property
    def _skips_value_pretraining(self) -> bool:
        learns_values = self.actor_critic.learns_values
        return self.args.value_pretrain_steps == 0 or self.run_record.critic_pretrained or not learns_values

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """AdamW (or `args.optim`) with separate parameter groups, and learning rates, for the actor and critic."""
        if self.optimizer is None:
            args = self.args
            decay = set(self.get_decay_parameter_names(self.actor_critic))
            groups = parameter_groups(
                self.actor_critic, decay, args.learning_rate, args.critic_learning_rate, args.weight_decay
            )
            # (its `lr` kept as the default: each group sets its own, and optimi's StableAdamW has no default rate)
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(args, self.actor_critic)
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
            if "bitsandbytes" in str(optimizer_cls) and optimizer_kwargs.get("optim_bits") == 8:
                # As transformers' `create_optimizer`: the embeddings' Adam state stays 32-bit (8-bit state there
                # destabilises training, bitsandbytes' advice), the rest is 8-bit.
                import bitsandbytes

                manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
                for module in self.actor_critic.modules():
                    if isinstance(module, nn.Embedding):
                        manager.register_module_override(module, "weight", {"optim_bits": 32})
        else:  # a user's own (`optimizers=`)
            args = self.args
            critic_only_steps = self.run_plan.pretrain_steps > 0 or args.critic_num_iterations > args.num_iterations
            name_groups_by_side(self.optimizer, self.actor_critic, self.is_deepspeed_enabled and critic_only_steps)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """Per-side schedules (`trl_vapo.optim.side_schedules`): the actor's starts with its first update. Their
        lengths come from the run plan (`run_plan`: value pretraining's steps, then the RL steps), not from
        `num_training_steps`, transformers' one total, which is not read."""
        if self.lr_scheduler is None:
            plan = self.run_plan
            self._created_lr_scheduler = True  # (transformers' flag: `train()` builds it again for its own plan)
            self.lr_scheduler = side_schedules(
                optimizer or self.optimizer,
                self.args.lr_scheduler_type,
                self.args.get_warmup_steps,
                plan.rl_steps,
                plan.pretrain_steps,
                0 if self._skips_value_pretraining else None,
                self.args.lr_scheduler_kwargs,
            )
        return self.lr_scheduler

    # -------------------------------------------------------------------------------------------- training
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial=None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        """Run value pretraining (unless skipped) then VAPO; `resume_from_checkpoint` continues a saved run. The run
        holds `output_dir` while it trains (`holding_output_dir`): a second run there is refused. (transformers'
        signature: a misspelt keyword is a TypeError, not a fresh run; `trial` and `ignore_keys_for_eval` are taken
        and unused, as GRPOTrainer's evaluation has no ignored keys either.)"""
        with self.holding_output_dir():
            return self._train(resume_from_checkpoint)

    @contextlib.contextmanager
    def holding_output_dir(self, alone: bool = False):
        """Hold `output_dir` for this run (`run_lock.output_dir_lock`, on the main process; every process raises
        where it is refused), and remove what a stopped run left half-written there. `train` holds it; a command
        that goes on to evaluate and save the model holds it around all of that (`trl-vapo train`), or a second run
        could start as the first saves, and remove its half-written model as debris. Held once: `train` inside
        holds nothing more. `alone`: called on the main process alone (`save_model` where the weights are whole on
        every process), which holds it without the others."""
        if getattr(self, "_holding_output_dir", False):
            yield
            return
        with contextlib.ExitStack() as held:

            def hold() -> tuple[str, bool]:  # on the main process; refused where another holds it or it is read-only
                # What a stopped run left half-written: all of it while no other run can be writing it; where the
                # folder cannot be locked, that of this host's runs that are gone.
                locked = held.enter_context(output_dir_lock(self.args.output_dir))
                removed, restored, published = ckpt.remove_debris(self.args.output_dir, dead_runs_only=not locked)
                if removed:
                    logger.info(f"Removed what a stopped run left half-written: {', '.join(removed)}")
                if restored:  # a stop between a checkpoint's two renames, as it replaced one of the same step
                    logger.warning(f"Restored {', '.join(restored)}, which a stopped run was replacing.")
                if published:  # a stop after a checkpoint was written whole, before it was renamed in place
                    logger.warning(f"Published {', '.join(published)}, which a stopped run wrote whole.")
                return ckpt.run_owner(), bool(restored or published)

            # Every process stops, not the main one alone; all name temporary folders alike (`temporary_folder`).
            self._run_owner, moved = hold() if alone else decided_on_main(hold, self.accelerator)
            if moved:  # the checkpoint to resume from, looked for before (the command line does), is looked for again
                self._resume_point = None
            self._holding_output_dir = True
            try:
                yield
            finally:
                self._holding_output_dir = False

    def _plan(self, built: RunPlan | None = None) -> RunPlan:
        """The run's step counts from `args` as they are now (transformers' `train()` reads `max_steps` and
        `num_train_epochs` when it starts: set after the trainer was built, they ran the counts it was built with).
        What else the plan reads was built into the trainer (its batches, the prompts a rollout reads, whether value
        pretraining runs): changed since (`built`: the plan it was built with), it is refused."""
        args = self.args
        if built is not None and self.train_dataset is not self._prompts.dataset:
            # (transformers' train() builds its loader from the attribute: here the prompts were checked, their long
            # ones dropped, and their order fixed when the trainer was built; the plan counted the new set's, and the
            # run read the old one's)
            raise ValueError(
                "trainer.train_dataset was replaced after the trainer was built: build a new VAPOTrainer with it."
            )
        streamed = isinstance(self.train_dataset, IterableDataset)
        if streamed and args.max_steps <= 0:
            check_train_dataset(self.train_dataset, args)  # its refusal: a stream needs max_steps
        plan = RunPlan.from_config(
            args, None if streamed else len(self.train_dataset), value_pretraining=not self._skips_value_pretraining
        )
        built_in = ("prompts_per_rollout", "steps_per_pass", "pretrain_rollouts", "steps_per_pretrain_rollout")
        changed = [name for name in built_in if built is not None and getattr(plan, name) != getattr(built, name)]
        if changed:
            raise ValueError(
                f"The trainer's batches changed after it was built ({', '.join(changed)} of its plan: "
                "generation_batch_size, num_generations, steps_per_generation, gradient_accumulation_steps or "
                "value_pretrain_steps / value_pretrain_num_iterations were set on `trainer.args`). Set them in the "
                "VAPOConfig and build a new VAPOTrainer; max_steps and num_train_epochs may change before train()."
            )
        return plan

    def _train(self, resume_from_checkpoint: str | bool | None) -> TrainOutput:
        args = self.args
        if self.models_placed and (self.is_deepspeed_enabled or self.is_fsdp_enabled):
            # DeepSpeed wraps the optimizer's groups in its own, FSDP2 shards the weights in place: prepared a second
            # time (DeepSpeed's engine around its engine, a checkpoint loaded into sharded weights) they break.
            raise RuntimeError(
                "train() already placed the models under DeepSpeed or FSDP on this trainer (a call an error stopped): "
                "they cannot be placed again. Resume with a new VAPOTrainer, in a new process: "
                "train(resume_from_checkpoint=True) reads the last checkpoint (the error's, where it wrote one)."
            )
        resume_from_checkpoint, marker = self.resume_point(resume_from_checkpoint)
        self._resume_point = None  # a later `train` looks again
        if self.state.global_step > 0 and not resume_from_checkpoint:
            # Its position, its value-pretraining phase and its schedules are the first run's: a second run from them
            # would skip value pretraining and continue the schedules (a decayed rate held at 0).
            raise RuntimeError(
                f"train() already ran on this trainer (to step {self.state.global_step}). To go on, resume from a "
                "checkpoint: train(resume_from_checkpoint=True). To train the result anew, start a new run: "
                "save_model(), then a new VAPOTrainer with that folder as `model` (a LoRA run's adapter trains on: no "
                "peft_config) and its `critic/` as `value_model` to keep the critic, with value_pretrain_steps=0: it "
                "is trained already."
            )
        # What a call that an error stopped left is not this one's, which resumes before that error's step: its
        # step's readings not yet logged (logged twice), a pending evaluation or checkpoint, its rollouts, and its
        # gradients (the critic's backward runs in a rollout's scoring pass, before the optimizer step).
        self._metrics.clear()
        self.run_plan = self._plan(self.run_plan)  # as transformers: `args.max_steps` set since, read by this call
        if not resume_from_checkpoint:  # (no step was taken: refused above) an error stopped a first call before its
            # first step, after its rollout's prompts were read and sampled: this call starts as a new trainer would,
            # from the first prompt and the seeded random state (it skipped them, and sampled other completions)
            self.progress = TrainingProgress(phase=RL if self._skips_value_pretraining else VALUE_PRETRAIN)
            self._prompts.restart()
            set_seed(sampling_seed(args, self.accelerator.process_index))
        self._save_pending = self._evaluate_pending = False
        self._last_rollout = self._reported_rollout = None
        self._replay = []
        self.actor_critic.zero_grad(set_to_none=True)
        self.is_in_train = True
        callbacks = self.callback_handler.callbacks + [self.control]
        self.state = TrainerState(stateful_callbacks=[cb for cb in callbacks if isinstance(cb, ExportableState)])
        self.state.max_steps = self.run_plan.planned_steps  # a resume reads its progress
        self.state.num_train_epochs = self.run_plan.epochs(self.progress)
        self.state.compute_steps(args, self.state.max_steps)
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.state.is_world_process_zero = self.is_world_process_zero()
        self.state.train_batch_size = args.per_device_train_batch_size

        self._prompts.restart()  # where `progress` says, after a resume too
        if self._created_lr_scheduler:  # as transformers: the schedules of this call's plan, not an earlier call's
            self.lr_scheduler, self._created_lr_scheduler = None, False  # (a resume extended: the actor's sat at 0)
        self.create_optimizer()
        self.create_scheduler(self.state.max_steps)
        if isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):  # (its step() wants a metric)
            raise ValueError(
                "lr_scheduler is a ReduceLROnPlateau, which steps on an evaluation's metric: VAPO steps its schedules "
                "once an optimizer step, each side's on its own (the actor's starts with RL). Use an "
                "lr_scheduler_type (constant, constant_with_warmup, linear, cosine), or a scheduler whose step() "
                "takes no argument."
            )
        self._note_learning_rates()  # what a log reads even before the first step (an epoch end on resuming)
        if args.gradient_checkpointing or self.actor_critic.is_gradient_checkpointing:
            # Also where the model came with it on (peft's prepare_model_for_kbit_training, a user's
            # gradient_checkpointing_enable()): made adapter-aware, or the shared-base critic's backward would replay
            # its layers under the policy's adapter.
            self.actor_critic.gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)
        if self.is_deepspeed_enabled:
            # Actor and critic are clipped separately in `_clip_gradients`; DeepSpeed would clip their joint norm.
            self.accelerator.state.deepspeed_plugin.deepspeed_config["gradient_clipping"] = 0.0
        critic_only_steps = not self._skips_value_pretraining or args.critic_num_iterations > args.num_iterations
        if critic_only_steps and args.ddp_find_unused_parameters is not False:
            # Critic-only steps leave the policy out of the forward pass; DDP must expect unused parameters.
            handler = self.accelerator.ddp_handler or DistributedDataParallelKwargs()
            handler.find_unused_parameters = True
            self.accelerator.ddp_handler = handler
        if resume_from_checkpoint is not None and self.is_fsdp_enabled:
            # FSDP2 shards the weights in place as it places them: the checkpoint's whole weights load before.
            self._load_weights(Path(resume_from_checkpoint))
        self.model_wrapped, self.optimizer = self.accelerator.prepare(self.actor_critic, self.optimizer)
        schedule_the_stepping_optimizer(self.lr_scheduler, self.optimizer)  # (DeepSpeed's offload swaps it)
        self.models_placed = True  # (FSDP2 shards `actor_critic` in place: `model_wrapped` is the same object)
        self.generation_engine.weights_changed()  # placed: cast (DeepSpeed's bf16), sharded, moved
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self._rng_state_file = None  # (`_load_checkpoint` names the one `_restore_random_state` loads)
        if resume_from_checkpoint is not None:
            self._load_checkpoint(Path(resume_from_checkpoint), marker)
            progress = self.progress
            if progress.phase == VALUE_PRETRAIN and (
                self._skips_value_pretraining or progress.value_pretrain_rollouts >= args.value_pretrain_steps
            ):
                # This run's value-pretraining budget (value_pretrain_steps lowered, or 0) is spent: RL starts here,
                # as at the end of a budget. The plan counts this run's budget: it could be behind the step reached,
                # and the run end without a step of RL.
                self._finish_value_pretraining(early=False)
            elif progress.phase == RL:  # this run's settings gave the critic's schedule the length it planned
                set_critic_length(self.lr_scheduler, self.optimizer, self.state.max_steps)
            self._note_learning_rates()  # the resumed schedules' (a log before the first step: an epoch end)

        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        start_time, start_step = time.time(), self.state.global_step
        # What `Trainer.log` reads for `train_tokens_per_second` (with `include_num_input_tokens_seen`), as
        # transformers' training loop sets them: this call's start, its tokens counted from there.
        self._train_start_time, self._initial_num_input_tokens_seen = start_time, self.state.num_input_tokens_seen
        self._loss_sum, self._loss_steps = 0.0, 0
        self._logged_step = None  # (a second train() on this trainer, resumed from an earlier step, logs it again)
        self._rewrite_log_file = True
        # The step of the last resumable checkpoint this run wrote (`_save_checkpoint`), or resumed from in its output
        # dir (the same state: an epoch end deferred to this run is recorded in it, else every resume ran it again)
        resumed_here = (
            resume_from_checkpoint is not None
            and Path(resume_from_checkpoint).resolve()
            == (Path(args.output_dir) / f"{ckpt.CHECKPOINT_PREFIX}-{start_step}").resolve()
        )
        self._checkpoint_step = start_step if resumed_here else None
        if self.progress.epoch_ended_step is None:  # a checkpoint from before it was recorded: taken as done
            self.progress.epoch_ended_step = start_step
        self._epoch_begun = False  # `on_epoch_begin` for the epoch this call starts in (`_next_rows`)
        if args.eval_on_start:
            self.evaluate()
        self._restore_random_state()
        self.model_wrapped.train()
        with stop_on_signals() as received:
            if received.uncaught:
                logger.warning(
                    "These stop signals will not write a checkpoint before the run ends: "
                    + "; ".join(f"{name} ({why})" for name, why in received.uncaught.items())
                    + ". Such a stop loses what was trained since the last checkpoint."
                )

            def stop_if_signalled() -> None:
                asked = self._all_reduce(torch.tensor(float(received.signum is not None), device=self.args.device))
                if asked.item():  # every process stops at the same point
                    self._stop_after_signal(signal.Signals(received.signum or signal.SIGTERM))

            rollouts = prompts = 0
            # As transformers' epoch loop: the planned epochs end the run, also where a callback cut one short
            # (`should_epoch_stop`: a third epoch began to make up max_steps' steps).
            while (
                self.state.global_step < self.state.max_steps
                and not self.control.should_training_stop
                and self._prompts.epochs_read(self.progress) < self.run_plan.epochs(self.progress)
            ):
                self._train_on_rollout()
                stop_if_signalled()
                rollouts += 1
                prompts = rollouts * self.run_plan.prompts_per_rollout
                unscored = rollouts >= UNSCORED_ROLLOUTS_BEFORE_STOP and prompts >= UNSCORED_PROMPTS_BEFORE_STOP
                if self.progress.scored_completions == 0 and unscored:
                    # Nothing scored, nothing trained: the policy samples alike, and the run would skip every
                    # update to its end (a reward's column missing, a format the model never writes).
                    break
            if self.state.global_step > start_step and self.progress.scored_completions == 0:
                self.control = self.callback_handler.on_train_end(args, self.state, self.control)  # trackers close
                self.is_in_train = False
                stopped = (
                    f"; stopped after {rollouts} rollouts of {prompts} prompts, "
                    "since the policy samples alike while nothing trains"
                    if self.state.global_step < self.state.max_steps
                    else ""
                )
                raise RuntimeError(
                    f"No completion was scored in this run ({self.state.global_step} steps, every update skipped"
                    f"{stopped}): each reward function ({', '.join(self.reward_func_names)}) returned None for every "
                    "completion. Check that the columns they read (e.g. `answer`) are in the dataset and that they "
                    "return a float for the completions they can judge."
                )
            if 0 < self.state.global_step != self.progress.epoch_ended_step:  # transformers ends the last epoch too
                # (its evaluation and checkpoint may take minutes: a signal then stops with a checkpoint too; a run
                # stopped before it, at its last step, runs it when resumed)
                self._end_epoch(completed=False)
                self._save_if_pending()
                self._record_epoch_end()
                stop_if_signalled()
        if args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model()

        steps = self.state.global_step - start_step
        # Samples as transformers counts them for GRPOTrainer: each optimizer step's batch (completions), the
        # critic-only steps' too.
        samples = steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        metrics = speed_metrics("train", start_time, num_samples=samples, num_steps=steps)
        metrics["train_loss"] = self._loss_sum / max(self._loss_steps, 1)
        metrics["total_flos"] = self.state.total_flos  # as transformers reports it (0: no model's FLOPs are counted)
        # The steps after the last log, logged at the step they end with (the curves, the model card and the summary's
        # last logs read the phased rows), and averaged into the summary row too, as GRPOTrainer's (its callers and
        # tests read `log_history[-1]`: `rewards/<name>/mean`, `reward`, `aux_loss`).
        logged = args.logging_strategy != IntervalStrategy.NO
        pending = averaged_metrics({key: values for key, values in self._metrics.items() if values}) if logged else {}
        self._log_pending_metrics()
        # (before on_train_end, which closes the trackers' writers; it adds `epoch`, as transformers, which train()'s
        # metrics return)
        summary = {**pending, **metrics}
        self.log(summary)
        metrics.update({key: value for key, value in summary.items() if key not in pending})
        self._write_plots()
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self._finish_current_push()  # as transformers: the last checkpoint's upload ends with the run
        written = ckpt.list_checkpoints(args.output_dir, up_to=self.state.global_step)
        newest = written[-1:] if args.push_to_hub else []
        if newest and self.is_world_process_zero():  # what the uploads read, past save_total_limit until now
            self._rotate_checkpoints(newest[0])
        best = self.state.best_model_checkpoint
        if args.save_total_limit == 1 and best is not None and self.is_world_process_zero():
            # As transformers ends a run with one checkpoint kept: the best alone (the rotation kept the newest beside
            # it, for a resume).
            ckpt.rotate_checkpoints(args.output_dir, 1, keep=[Path(best)])
        self.is_in_train = False
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _train_on_rollout(self) -> None:
        """Steps 1-4 build the rollout (`_make_rollout`), step 5 trains on it: shuffled passes (RL:
        `critic_num_iterations`, the first `num_iterations` with the policy; value pretraining:
        `value_pretrain_num_iterations`)."""
        args, phase = self.args, self.progress.phase
        # GRPOTrainer's `step_time`: a rollout's sampling and scoring count in its first optimizer step.
        began = time.perf_counter()
        rows = self._next_rows()
        if self.control.should_training_stop:  # asked at a stream's epoch end, met as these rows were read
            return
        # The rollout's sampling and scoring belong to its first step, as GRPOTrainer generates inside its training
        # step: a callback that times or profiles steps from `on_step_begin` to `on_step_end` sees them.
        self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
        try:
            rollout = self._make_rollout(rows, phase)
        except Exception as error:  # a reward function's, a rollout_func's, an out-of-memory sampling: as evaluation's
            # On one process the steps trained so far are saved first (this rollout's prompts, read, are left out of
            # a resume); on several, the error may be one process's alone, and the others would wait for it in the
            # checkpoint's collectives. The weights are the last rollout's: nothing of this one stepped.
            if not self._distributed:
                self._checkpoint_before_error(error, rows_read_again=False)
            raise
        all_reduce = self._all_reduce if self._distributed else None
        metrics = rollout_metrics(rollout, self.accelerator.gather, all_reduce)
        metrics.update(
            rollout_diagnostics(rollout, args.max_completion_length, args.diagnostic_position_buckets, all_reduce)
        )
        self._record(metrics)
        scored = torch.tensor(float(rollout.scores.scored.sum()), device=rollout.loss_mask.device)
        self.progress.scored_completions += int(self._all_reduce(scored).item())
        if phase == RL and self.actor_critic.learns_values and self.accelerator.is_main_process:
            # (a frozen value function's bias is its own: the watch's advice, more pretraining, does not apply)
            self._critic_bias.update(metrics.get(POSITION_CORRELATION, math.nan), self.progress)
        self._last_rollout = rollout
        for callback in self.callback_handler.callbacks:  # an extension point: see the class docstring
            if hasattr(callback, "on_rollout"):
                callback.on_rollout(args, self.state, self.control, rollout=rollout, rows=rows)

        # Step 5: shuffled passes over the rollout; the passes beyond num_iterations train the critic alone. With
        # value pretraining's replay, each pass draws one rollout's worth of samples from the window of rollouts.
        rows_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        passes = args.critic_num_iterations if phase == RL else args.value_pretrain_num_iterations
        trains_on = rollout
        if phase == VALUE_PRETRAIN and args.value_pretrain_replay > 0:
            self._replay = (self._replay + [rollout])[-(args.value_pretrain_replay + 1) :]
            trains_on = concatenate_rollouts(self._replay)
        steps = (
            (rows, n < args.num_iterations)
            for n in range(passes)
            for rows in torch.randperm(len(trains_on))[: len(rollout)].split(rows_per_step)
        )
        begun = True  # the first step's `on_step_begin` came before its rollout
        first, last = self._rollout_epochs
        count = passes * -(-len(rollout) // rows_per_step)
        for done, (step_rows, update_policy) in enumerate(steps, 1):
            self.state.epoch = first + (last - first) * done / count
            self._optimizer_step(trains_on, step_rows, update_policy, began, begun)
            began, begun = time.perf_counter(), False
            # (`should_epoch_stop` as transformers reads it: its epoch loop ends at once, the step's rollout here)
            stop = self.control.should_training_stop or self.control.should_epoch_stop
            if stop or self.state.global_step >= self.state.max_steps:
                break

        if phase == VALUE_PRETRAIN:
            self._after_value_pretrain_rollout(metrics[EXPLAINED_VARIANCE])
        if self._prompts.epoch_is_over(self.progress):
            self._end_epoch()
        elif self.control.should_epoch_stop:  # a callback ended the epoch early, as transformers lets it
            self._end_epoch()
            self._prompts.skip_to_next_epoch(self.progress)  # (before the checkpoint: a resume starts the next one)
        self._save_if_pending()

    def _stop_after_signal(self, signum: signal.Signals) -> None:
        """A stop signal arrived during the rollout just trained on: log the steps since the last log, write the
        checkpoint (unless the rollout's end wrote it), end the callbacks' run (`on_train_end`: the trackers flush and
        close their writers), as transformers' own stop on SIGTERM (`enable_jit_checkpoint`) ends its loop, say so in
        one line, and raise `TrainingInterrupted`."""
        self._log_pending_metrics()  # (lost before: logging_steps=50 and a stop at step 149)
        path, _ = self._checkpoint_now()
        try:
            self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
            pushes = getattr(self, "push_in_progress", None)
            failed = [job.exception() for job in (pushes.jobs if pushes else []) if job.exception() is not None]
            upload = (  # said, not only waited for: the stop's one copy on a machine whose disk goes with it
                f" An upload to the Hub ({self.hub_model_id}) failed, {type(failed[0]).__name__}: {failed[0]}; the "
                "Hub may not hold this step."
                if failed
                else ""
            )
            message = (
                f"Stopped by {signum.name} at step {self.state.global_step}: {path} holds every step so far; "
                f"{RESUME}.{upload}"
            )
            if self.accelerator.is_main_process:
                logger.warning(message)
        finally:  # (a callback's error on the main process alone: the others leave with it, not wait for it)
            if self._distributed:
                # Every process leaves once the main one's upload and trackers are done: a launcher that sees a
                # worker exit with the signal's code stops the others (torchrun's agent, a Slurm step), the main one
                # mid-upload.
                self.accelerator.wait_for_everyone()
        self.is_in_train = False
        raise TrainingInterrupted(signum, path, message)

    def _log_pending_metrics(self, phase: str | None = None) -> None:
        """Log the metrics of the steps since the last log, if any, as `phase`'s (None: the run's phase now); with
        logging off, drop them (transformers logs nothing then: kept, the whole run's readings went into `train()`'s
        summary row, averaged, and value pretraining's into RL's readings)."""
        if self.args.logging_strategy == IntervalStrategy.NO:
            self._metrics.clear()
        elif any(self._metrics.values()):
            self._log_metrics(phase or self.progress.phase)

    def _checkpoint_now(self) -> tuple[Path, bool]:
        """The steps trained so far as a checkpoint, before the run stops between two rollouts (a checkpoint holds
        whole rollouts): by a stop signal, or an error. Written unless this step's is (whole, whatever
        `save_only_model` says: it is to resume from), and with `push_to_hub` uploaded and waited for. Every process
        calls it (a collective). Returns its path and whether it was written before (by the run's strategy)."""
        path = Path(self.args.output_dir) / f"{ckpt.CHECKPOINT_PREFIX}-{self.state.global_step}"
        written_before = self._checkpoint_step == self.state.global_step  # this run's own record: every process's
        if not written_before:
            # This step's model-only checkpoint (`save_only_model`) may have been uploaded: the whole one replaces its
            # folder, and is uploaded too (`last-checkpoint/` held the model alone, nothing to resume from).
            self._uploads_read = [read for read in getattr(self, "_uploads_read", []) if read != path]
            self._save_checkpoint(model_only=False)
        if self.args.push_to_hub:
            # Its upload was skipped behind a running one (one at a time): queued now, after the checkpoint is on the
            # disk (a launcher's kill comes some 30 s after a signal), and waited for: on a machine whose disk goes
            # with it, the upload is the checkpoint's only copy.
            if path not in getattr(self, "_uploads_read", []):
                self._push_from_checkpoint(str(path), always=True)
            self._finish_current_push()
        return path, written_before

    def _checkpoint_before_error(self, error: BaseException, rows_read_again: bool | None = None) -> None:
        """An error that stops the run between two rollouts: the steps trained so far written as a checkpoint
        (`_checkpoint_now`; none at step 0), named in a log line and in the error's note (Python 3.10 has no notes;
        a launched process's stderr may be read apart from its traceback). For a rollout that failed (`rows_read_again`
        given), what a resume from it reads: the rollout's prompts again where they were refused as they were read
        (`rows_read_again`: a stream's row, a `drop_long_prompts` filter's check, a stream short of a rollout) or the
        checkpoint was written before them (at the last rollout's end, or a stream's epoch end), else on after them
        (a map-style set's rollout that failed said neither)."""
        if self.state.global_step == 0:
            return
        path, written_before = self._checkpoint_now()
        message = f"{path} holds the {self.state.global_step} steps so far: {RESUME}"
        if rows_read_again is not None:
            mend = ": mend the stream first" if rows_read_again else ""  # (a row it refused)
            message += f"; a resume reads this rollout's prompts again{mend}" if (
                rows_read_again or written_before
            ) else "; a resume reads on after this rollout's prompts (they are left out)"  # fmt: skip
        if hasattr(error, "add_note"):
            error.add_note(message + ".")
        if self.accelerator.is_main_process:
            logger.warning(message + ".")

    def _save_if_pending(self) -> None:
        """The evaluation and the checkpoint a step or an epoch end asked for, once its rollout is done: a checkpoint
        holds whole rollouts, and the evaluation waits with it so that the checkpoint holds the weights evaluated
        (`best_model_checkpoint`, `save_strategy="best"`; with several optimizer steps a rollout, one evaluated
        mid-rollout was saved steps later, and was never named the best)."""
        if self._evaluate_pending:
            self._evaluate_pending = False
            try:
                metrics = self.evaluate()
                # As transformers: the callbacks see the evaluation (early stopping compares with the best so far),
                # then `metric_for_best_model` updates the best, which `save_strategy="best"` saves. A name no
                # evaluation logs (a typo: which names a reward's `log_metric` adds is known only now) is a KeyError
                # listing the names, after the steps so far are saved below.
                new_best = self._determine_best_metric(metrics, trial=None)
            except Exception as error:  # (a reward function's on the held-out rows, a streamed row refused, ...)
                # On one process the steps trained so far are saved first; on several, the error may be one
                # process's alone, and the others would wait for it in the checkpoint's collectives.
                if not self._distributed:
                    self._checkpoint_before_error(error)
                raise
            self._save_pending |= self.control.should_save  # as transformers reads it after `on_evaluate`
            self._save_pending |= new_best and self.args.save_strategy == SaveStrategy.BEST
        if self._save_pending:
            self._save_checkpoint()
            self._save_pending = False

    def _log_evaluate_save(self) -> None:
        """What the callbacks asked for at the end of a step or an epoch, in transformers' order: the log, then an
        evaluation and a checkpoint, both when the rollout ends."""
        if self.control.should_log:
            self._log_metrics(self.progress.phase)
        elif self.args.logging_strategy == IntervalStrategy.NO:
            self._metrics.clear()  # dropped: not held for the run's length (`_log_pending_metrics`)
        # Not during value pretraining: the policy does not change, and early stopping would compare readings of the
        # initial policy, whose noise alone could end the run before its first update.
        # The request is consumed either way (as `on_evaluate` would): left set, the epoch end of the rollout that
        # ends value pretraining read it in RL and evaluated the initial policy.
        # Nor at the end of its last rollout, in RL by then before any update (an epoch that ends with it).
        progress = self.progress
        policy_trained = progress.phase != VALUE_PRETRAIN and self.state.global_step != progress.rl_start_step
        self._evaluate_pending |= self.control.should_evaluate and policy_trained
        self.control.should_evaluate = False
        self._save_pending |= self.control.should_save

    def _end_epoch(self, completed: bool = True, epochs_done: int | None = None) -> None:
        """An epoch of the prompts ended (`completed`; `epochs_done` counts it, default the epoch `progress` is in),
        or training did: the callbacks' `on_epoch_end`, then the log, evaluation and checkpoint that the "epoch"
        logging / eval / save strategies ask for."""
        self.progress.epoch_ended_step = self.state.global_step
        if completed:  # its last rollout may have left a few prompts unused: the epoch is over all the same
            self.state.epoch = float(self.progress.data_epoch + 1 if epochs_done is None else epochs_done)
        self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
        self._log_evaluate_save()

    def _begin_epoch(self) -> None:
        self._epoch_begun = True
        self.control = self.callback_handler.on_epoch_begin(self.args, self.state, self.control)

    def _end_streamed_epoch(self) -> None:
        """A stream ran out as the next rollout read it: its epoch ended with the rollout before. What the epoch
        strategies ask for happens now, on the weights of that rollout (it waited for the next rollout's end, and
        was saved under the next step's name); the position saved is the next epoch's start, where a resume begins.
        Then the next epoch begins."""
        self._end_epoch(epochs_done=self.progress.data_epoch)  # (`progress` is at the next epoch's start)
        self._save_if_pending()
        if not self.control.should_training_stop:  # (a stop asked at the epoch's end begins none: it would never end)
            self._begin_epoch()

    def _next_rows(self) -> list[dict[str, Any]]:
        """This process's share of the next rollout: each prompt repeated `num_generations` times. A stream that ran
        out ends its epoch on the way (`_end_epoch`: the callbacks, and what the epoch strategies ask for)."""
        args, progress = self.args, self.progress
        if self._prompts.starts_epoch(progress) or not self._epoch_begun:  # (a resumed run's epoch too)
            self._begin_epoch()
            if self.control.should_training_stop:  # a callback's stop at the epoch's begin: no prompt is read (the
                return []  # run's last checkpoint would have skipped them, a resume never trained on them)
        ending_epoch, read = False, False

        def end_epoch() -> bool:  # what an epoch's end raises (its evaluation, a callback) is not the stream's
            nonlocal ending_epoch
            ending_epoch = True
            self._end_streamed_epoch()
            ending_epoch = False
            return not self.control.should_training_stop

        try:
            prompts = self._prompts.next(progress, on_epoch_end=end_epoch)
            read = True
            if not prompts:  # a stop asked at a stream's epoch end (the caller reads `should_training_stop`)
                return []
            if self._prompts.streamed:  # a map-style set's rows were checked up front, a stream's first alone
                check_streamed_rows(
                    prompts, f"train_dataset (the rollout read from the stream at step {self.state.global_step})"
                )
                empty = [row["prompt"] for row in prompts if not row["prompt"]]
                if empty and self.rollout_func is None:  # one the tokenizer gives no token (Qwen's adds none) is
                    # refused here, the steps so far checkpointed first: the rollout's refusal lost them
                    self._tokenize_prompts(empty, truncate=False)
        except ValueError as error:  # a stream's row refused, or a stream short of a rollout: read as training goes
            if self._prompts.streamed and not ending_epoch:  # (every process reads, and refuses, the same rows)
                self._checkpoint_before_error(error, rows_read_again=not read)
            raise
        # The epochs the rollout's prompts span: its optimizer steps move `state.epoch` across them step by step, as
        # GRPOTrainer's move it (each step reads its share of the prompts); until then it reads the last step's, as
        # GRPOTrainer's does while it samples (the span's end here read 0.25, then 0.125 after the first step).
        self._rollout_epochs = (self.state.epoch or 0.0, self._prompts.epoch(progress))
        per_process = args.generation_batch_size // self.accelerator.num_processes
        start = self.accelerator.process_index * per_process
        return repeated_rows(prompts, args.num_generations, slice(start, start + per_process))

    def _tokenize_prompts(self, prompts: list, truncate: bool = True, evaluated: bool = False) -> list[list[int]]:
        """Token ids of the prompts (chat template applied to chat prompts), cut to their last `max_prompt_length`
        (`evaluated`: an evaluation set's, whose first cut is said apart from training's)."""
        ids = prompt_token_ids(self.processing_class, prompts, self._conversational, self.args.chat_template_kwargs)
        refuse_prompts_without_tokens(prompts, ids)
        limit = self.args.max_prompt_length
        if not truncate or limit is None:
            return ids
        longest = max(map(len, ids), default=0)
        which = "evaluation" if evaluated else "training"
        if longest > limit and which not in self._said_long_prompts:  # not counted before: a stream's, an eval set's
            self._said_long_prompts.add(which)
            logger.warning(
                f"{'An evaluation' if evaluated else 'A'} prompt of {longest} tokens is longer than max_prompt_length="
                f"{limit}: it and any later such prompt are truncated from the left (said once"
                f"{'; drop_long_prompts drops training prompts only' if evaluated else ''}). Raise max_prompt_length "
                "or set it to None to keep them whole."
            )
        return left_truncated(ids, limit)

    # ------------------------------------------------------------------------------------------ the rollout
    @torch.no_grad()
    def _make_rollout(
        self, rows: list[dict[str, Any]], phase: str, num_generations: int | None = None, counted: int | None = None
    ) -> Rollout:
        """Steps 1-4 of the loop on this process's rows (each prompt repeated `num_generations` times, default
        `args.num_generations`): sample, score, value, advantage. `counted`: only the first rows are this process's
        own; the rest repeat an evaluation batch's prompts so that it splits evenly over the processes, and are
        sampled and scored (the metrics are collectives) but left out of the loss mask, so of the advantages'
        whitening, the loss and the masked metrics."""
        args, device = self.args, self.accelerator.device
        # 1. Sample.
        prompts, prompt_mask, sample, rows = self._generate(
            rows, num_generations or args.num_generations, phase == EVAL
        )
        # 2. Score; the verdict of a completion that trains lands on its last token.
        completion_ids = sample.completion_lists()
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        prompt_lists = functools.cache(
            lambda: [ids[mask.bool()].tolist() for ids, mask in zip(prompts.cpu(), prompt_mask.cpu(), strict=True)]
        )
        parsed = self._conversational and parsed_completions(
            self.processing_class, completion_ids, prompt_lists, texts
        )
        extra_columns: dict[str, list] = defaultdict(list)  # TRL's `log_extra`: columns of the completions table
        reward_metrics: dict[str, list[float]] = defaultdict(list)  # TRL's `log_metric`
        scores = self.scorer.score(
            rows,
            parsed or texts,
            completion_ids,
            self.state,
            lambda name, value: reward_metrics[name].append(float(value)),
            lambda name, values: extra_columns[name].extend(values),
            # (a parsed message holds its reasoning apart: the parser read where the prompt opened it)
            None
            if parsed or not self.scorer.reads_thinking
            else prompt_opens_think(self.processing_class, prompt_lists()),
        )
        self._record_reward_metrics(reward_metrics)
        trains = scores.scored.to(device) & (sample.lengths > 0)
        if counted is not None:
            trains[counted:] = False
        if args.mask_truncated_completions:
            trains &= ~sample.is_truncated
        # The policy's tokens: the actions. An environment's (a rollout_func's `env_mask`) are context only.
        action_mask = sample.completion_mask * (1 if sample.action_mask is None else sample.action_mask)
        loss_mask = action_mask.float() * trains[:, None].float()
        # 3. Value, and the policy's log-probs before any update when the updates (or the IS correction) need them.
        input_ids = torch.cat([prompts, sample.completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, sample.completion_mask], dim=1)
        if phase != EVAL:  # GRPOTrainer's `num_tokens`: the prompt and sampled tokens trained on so far
            seen = prompt_mask.sum() + action_mask.sum()
            self.state.num_input_tokens_seen += int(self._all_reduce(seen).item())
        self._metrics["num_tokens"] = [float(self.state.num_input_tokens_seen)]  # (an evaluation's too, as GRPO's)
        corrects_sampler = (  # a rollout_func's log-probs correct with vLLM only, as GRPOTrainer's (without it they
            # feed the drift mask alone); an engine's own (asked with `logprobs=True`) correct as vLLM's
            phase == RL
            and (args.use_vllm or self.rollout_func is None)
            and sample.sampler_logprobs is not None
            and args.vllm_importance_sampling_correction
        )
        if phase == RL and args.use_vllm and args.vllm_importance_sampling_correction and not corrects_sampler:
            # (GRPOTrainer raised at `old - None`): said once, not silently trained without the correction asked for
            logger.warning_once(
                "The rollout_func returned logprobs=None: vLLM's sampling is not corrected for "
                "(vllm_importance_sampling_correction=True). Return the sampled tokens' log-probs, or set "
                "vllm_importance_sampling_correction=False.",
            )
        with_policy = phase == EVAL or self._needs_old_logprobs(phase) or corrects_sampler  # EVAL: for its loss
        reference = None
        if args.beta > 0 and self._kl_penalised(phase):
            reference = self.ref_model if self.ref_model is not None else self._peft_reference
        critic_trains_here = self._critic_trains_while_scoring(phase)
        old_logprobs, old_values, ref_logprobs, entropy = self.actor_critic.score_completions(
            input_ids,
            attention_mask,
            prompts.shape[1],
            batch_size=args.per_device_train_batch_size,
            temperature=args.temperature,
            with_policy=with_policy,
            with_values=not critic_trains_here,
            reference=reference,
            autocast=self.accelerator.autocast,
            pad_to_multiple_of=args.pad_to_multiple_of,
            with_entropy=phase == EVAL,  # GRPOTrainer's `eval_entropy` (a training rollout's is the update's)
        )
        is_correct = scores.is_correct(args.positive_reward_threshold).to(device)
        sequence_rewards = self._sequence_rewards(scores, num_generations or args.num_generations).to(device)
        rewards = terminal_rewards(sequence_rewards * trains, loss_mask)
        if ref_logprobs is not None:
            rewards = rewards - args.beta * (old_logprobs - ref_logprobs) * loss_mask
        critic_step = None
        if critic_trains_here:
            old_values, critic_step = self._critic_forward_backward(
                input_ids, attention_mask, prompts.shape[1], rewards, loss_mask, trains & is_correct
            )
        # 4. Advantage: decoupled, length-adaptive GAE (Monte-Carlo targets during value pretraining).
        lam_critic = 1.0 if phase == VALUE_PRETRAIN else args.lam_critic
        raw_advantages, returns, lambda_actor = decoupled_gae(
            rewards, old_values, loss_mask, args.gamma, args.lam_actor, lam_critic, args.length_adaptive_alpha
        )
        if phase == VALUE_PRETRAIN:
            raw_advantages = advantages = torch.zeros_like(loss_mask)
        elif args.whiten_advantages:
            advantages = masked_whiten(
                raw_advantages, loss_mask, all_reduce=self._all_reduce if self._distributed else None
            )
        else:
            advantages = raw_advantages
        is_weights, sampling_metrics = None, {}
        if corrects_sampler:
            is_weights = importance_sampling_weights(
                old_logprobs,
                sample.sampler_logprobs,
                loss_mask,
                args.vllm_importance_sampling_mode,
                args.vllm_importance_sampling_clip_max,
                args.vllm_importance_sampling_clip_min,
            )
            sampling_metrics = importance_sampling_metrics(
                old_logprobs, sample.sampler_logprobs, is_weights, loss_mask
            )
        return Rollout(
            phase=phase,
            input_ids=input_ids,
            attention_mask=attention_mask,
            prompt_length=prompts.shape[1],
            truncated=sample.is_truncated,
            scores=scores,
            action_mask=action_mask,
            loss_mask=loss_mask,
            is_correct=is_correct,
            is_positive=trains & is_correct,
            old_values=old_values,
            returns=returns,
            raw_advantages=raw_advantages,
            advantages=advantages,
            lambda_actor=lambda_actor,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            is_weights=is_weights,
            sampling_logprobs=sample.sampler_logprobs if args.off_policy_mask_threshold is not None else None,
            sampling_metrics=sampling_metrics,
            extra_columns=dict(extra_columns),
            pad_to_multiple_of=args.pad_to_multiple_of,
            group_size=num_generations or args.num_generations,
            critic_step=critic_step,
            entropy=entropy,
        )

    def _critic_trains_while_scoring(self, phase: str) -> bool:
        """Whether the critic's forward and backward for the rollout's one update run in its scoring pass, and its
        values come from that forward: the critic's forward then runs once per rollout, not twice.

        Exact where the update's critic forward would compute the same values on the same weights from targets known
        before them: one optimizer step per rollout and one pass over it (`critic_num_iterations=1`,
        `steps_per_generation = gradient_accumulation_steps`), `lam_critic=1` (the targets are the Monte-Carlo
        returns, which do not read the values; the value clip is then a no-op, the old values being the values), in
        RL, without dropout (`disable_dropout`, the default: with it the two forwards drew two masks), where the
        gradients can wait for the step's reduction (`_gradients_wait_for_the_step`: one process, or DDP).
        """
        args = self.args
        return (
            phase == RL
            and self.actor_critic.learns_values
            and args.critic_num_iterations == 1
            and args.steps_per_generation == args.gradient_accumulation_steps
            and args.lam_critic == 1.0
            and args.disable_dropout
            and self._gradients_wait_for_the_step
        )

    @property
    def _gradients_wait_for_the_step(self) -> bool:
        """Whether gradients left in `.grad` by a backward before the optimizer step's are reduced with the step's:
        on one process (nothing to reduce), and under DDP that finds unused parameters (its reduction at the step's
        last backward takes what every backward under `no_sync` left, also of parameters that last one did not
        use; transformers turns that on for a model that is not a `PreTrainedModel`, as the actor-critic is, unless
        `ddp_find_unused_parameters=False`). Not under DeepSpeed and FSDP, whose backward reduces into partitions or
        shards as it runs, nor under DDP without unused parameters, which would refuse the update's forward without
        the critic, nor under DDP's static graph (`ddp_static_graph`), whose reducer expects the one set of used
        parameters at every backward (a critic-only backward failed an internal assert in its reducer)."""
        if self._backward_is_local:
            return True
        wrapped = self.model_wrapped
        return (
            isinstance(wrapped, nn.parallel.DistributedDataParallel)
            and wrapped.find_unused_parameters
            and not wrapped.static_graph
        )

    def _critic_forward_backward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_length: int,
        rewards: torch.Tensor,
        loss_mask: torch.Tensor,
        is_positive: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The critic's part of the rollout's update, in the scoring pass (`_critic_trains_while_scoring`): in
        micro-batches of `per_device_train_batch_size`, its values' forward and the value loss's backward (the
        step's token mean, as `_optimizer_step` normalises it), the gradients left for the step. Returns the values
        (`[N, C]`, detached: GAE's) and the step's loss statistics, as `_optimizer_step` sums them. Under DDP the
        backward runs under `no_sync` (but with `sync_each_batch`): the update's last backward reduces the critic's
        gradients with the policy's (a reduction of gradients already reduced leaves them as they are)."""
        args = self.args
        _, returns = compute_gae(rewards, torch.zeros_like(rewards), loss_mask, args.gamma, 1.0)  # (lam 1: V unread)
        settings = self._loss_settings(RL, loss_mask, is_positive)
        values = torch.zeros_like(loss_mask)
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=loss_mask.device))
        batch_size, pad_to_multiple_of = args.per_device_train_batch_size, args.pad_to_multiple_of
        for rows, ids, attention, length in completion_micro_batches(
            input_ids, attention_mask, prompt_length, batch_size, pad_to_multiple_of
        ):
            with torch.enable_grad(), self._no_sync_unless_each_batch():
                with self.accelerator.autocast():
                    out = self.model_wrapped(
                        ids, attention, length, args.temperature, with_policy=False, with_values=True
                    )
                mask, new_values = loss_mask[rows, :length], out["values"]
                batch = {"mask": mask, "returns": returns[rows, :length], "old_values": new_values.detach()}
                loss, stats = vapo_loss(None, new_values, batch, **settings)
                self._backward(loss, last=False)  # (the step's last micro-batch is the update's, the policy's)
            values[rows, :length] = new_values.detach()
            sums["loss"] += loss.detach()
            for key, value in stats.items():  # as `_optimizer_step` sums them: losses as they are, others by tokens
                sums[key] += value if key.startswith("loss") else value * mask.sum()
            del out, loss, new_values
        return values, dict(sums)

    @contextlib.contextmanager
    def _generation_model(self):
        """The policy to sample from, unwrapped from DDP / DeepSpeed / FSDP, under autocast (the engines' provider)."""
        with (
            unwrapped_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_zero3=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            fsdp2_unsharded(self.model_wrapped),
            self.accelerator.autocast(),
        ):
            yield unwrapped.policy

    def _generate(
        self, rows: list[dict[str, Any]], num_generations: int, evaluated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, GenerationOutput, list[dict[str, Any]]]:
        """Left-padded prompts, their mask, and one completion per row (the rows come in groups of `num_generations`
        copies of a prompt), from the generation engine or the `rollout_func`; and the rows the reward functions
        read (with the rollout_func's other fields). `evaluated`: the rows are an evaluation set's."""
        device, pad_id = self.accelerator.device, self.processing_class.pad_token_id
        # vLLM holds its own copy of the policy: push it once per optimizer step (a no-op for the other engines),
        # before a rollout_func too, which may sample with it.
        self.generation_engine.sync_weights(self.state.global_step if self.progress.phase == RL else -1)
        if self.rollout_func is None:
            prompt_ids = self._tokenize_prompts([row["prompt"] for row in rows], evaluated=evaluated)
            sample = self.generation_engine.generate(prompt_ids, num_generations=num_generations)
        else:  # GRPOTrainer's call: the prompts as the dataset holds them (copies: it may edit them), and the trainer
            self.generation_engine.prepare_backend()  # `trainer.vllm_generation` samples as the engine would
            output = self.rollout_func([copy.deepcopy(row["prompt"]) for row in rows], self)
            prompt_ids, sample, fields = read_rollout_func_output(
                output, len(rows), self._stop_ids, pad_id, keep_logprobs=self._reads_sampler_logprobs
            )
            rows = rows_with_fields(rows, fields)
        sample = sample.padded(self.args.pad_to_multiple_of, pad_id).to(device)
        multiple = self.args.pad_to_multiple_of
        prompts = [torch.tensor(x) for x in prompt_ids]
        prompts = pad(prompts, padding_value=pad_id, padding_side="left", pad_to_multiple_of=multiple)
        prompt_mask = [torch.ones(len(x), dtype=torch.long) for x in prompt_ids]
        prompt_mask = pad(prompt_mask, padding_side="left", pad_to_multiple_of=multiple)
        return prompts.to(device), prompt_mask.to(device), sample, rows

    @property
    def _reads_sampler_logprobs(self) -> bool:
        """Whether a rollout_func's log-probs are kept: vLLM's importance-sampling correction reads them, and the
        off-policy mask measures the sampler's drift with them whatever the backend (GRPOTrainer keeps them so)."""
        return self.args.use_vllm or self.args.off_policy_mask_threshold is not None

    def _needs_old_logprobs(self, phase: str) -> bool:
        """Whether the updates need log-probs from before the first update of the rollout.

        With one optimizer step per rollout and one pass over it, each sample trains the policy that sampled it: the
        old log-probs equal the update's own (detached), so the extra forward pass is skipped, as in TRL's
        GRPOTrainer. The KL penalty (`beta > 0`) needs them wherever it applies (`_kl_penalised`).
        """
        args = self.args
        if args.beta > 0 and self._kl_penalised(phase):
            return True
        return phase == RL and (
            args.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps
        )

    def _kl_penalised(self, phase: str) -> bool:
        """Whether the rewards of this phase's rollouts carry the KL penalty. Value pretraining's policy is the
        reference itself: a copy under full fine-tuning and for an adapter that is not a new LoRA's (given trained,
        PiSSA, a random start), the base where a new LoRA computes as it (B zero). KL 0: no log-prob passes.
        Evaluation measures what RL optimises, the penalty included."""
        return phase != VALUE_PRETRAIN

    # ----------------------------------------------------------------------------------------- the update
    def _optimizer_step(
        self,
        rollout: Rollout,
        rows: torch.Tensor,
        update_policy: bool = True,
        began: float | None = None,
        begun: bool = False,
    ) -> None:
        """One optimizer step over `rows` of the rollout, split into `gradient_accumulation_steps` micro-batches; the
        critic's alone during value pretraining and without `update_policy`. `began`: when the step's time began
        (logged as GRPOTrainer's `step_time`; default: now); `begun`: the callbacks' `on_step_begin` was called.

        The token mean spans the whole step: every micro-batch's loss is divided by the step's token count summed
        over micro-batches and processes (times the process count, which DDP's gradient averaging divides back).
        """
        began = time.perf_counter() if began is None else began
        args, phase = self.args, rollout.phase
        trains_policy = phase == RL and update_policy
        on_device = rows.to(rollout.loss_mask.device, non_blocking=True)
        mask = rollout.loss_mask[on_device]
        settings = self._loss_settings(phase, mask, rollout.is_positive[on_device])
        spans = padding_spans(rollout.attention_mask, rollout.prompt_length)  # (the micro-batches' widths: one read)

        if not begun:
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=mask.device))
        extremes: dict[str, list[torch.Tensor]] = defaultdict(list)
        controls_entropy = trains_policy and args.use_adaptive_entropy
        entropy_reading = torch.zeros(2, device=mask.device)  # the controller's: the entropy's sum and its tokens
        if args.top_entropy_quantile >= 1.0:  # (its threshold is each micro-batch's, GRPOTrainer's: of drawn rows)
            rows = length_sorted(rows, spans[:, 1])
        micro_batches = rows.split(args.per_device_train_batch_size)
        # The critic's forward and backward ran in the scoring pass (`_critic_trains_while_scoring`): its gradients
        # wait in `.grad`, its statistics join this step's.
        critic_step, rollout.critic_step = rollout.critic_step, None
        learns_values = self.actor_critic.learns_values and critic_step is None
        for key, value in (critic_step or {}).items():
            sums[key] += value
        passes = self._update_passes(trains_policy, learns_values)
        for i, micro_rows in enumerate(micro_batches):
            batch = rollout.micro_batch(micro_rows, spans)
            n = batch["mask"].sum()
            sums["_tokens"] += n
            for j, (with_policy, with_values) in enumerate(passes):
                last = i == len(micro_batches) - 1 and j == len(passes) - 1  # the backward that reduces the step's
                no_sync = not last and not self.is_deepspeed_enabled  # (DeepSpeed: `_backward` names the step's last)
                with self._no_sync_unless_each_batch() if no_sync else contextlib.nullcontext():
                    with self.accelerator.autocast():
                        out = self.model_wrapped(
                            batch["input_ids"],
                            batch["attention_mask"],
                            batch["completion_length"],
                            args.temperature,
                            with_policy=with_policy,
                            with_values=with_values,
                        )
                    masks = self._token_masks(out, batch) if trains_policy and "logprobs" in out else {}
                    loss, stats = vapo_loss(
                        out.get("logprobs"), out.get("values"), batch, entropy=out.get("entropy"), **masks, **settings
                    )
                    for key, value in stats.items():  # losses are shares of the step's mean; most others token means
                        if key in STEP_EXTREMES:  # over the step's sequences
                            extremes[key].append(value)
                        elif key in SEQUENCE_MEANS:  # weighted by the micro-batch's sequences with a token
                            sequences = (batch["mask"].sum(dim=1) > 0).sum()
                            sums[key] += value * sequences
                            sums["_sequences"] += sequences
                        else:
                            sums[key] += value if key.startswith("loss") else value * n
                    if "entropy" in out:
                        sums["entropy"] += masked_mean(out["entropy"].detach(), batch["mask"]) * n
                        if controls_entropy:  # over the tokens the bonus acts on, as GRPOTrainer's controller
                            top = masks.get("entropy_mask")
                            acted = batch["mask"] if top is None else batch["mask"] * top
                            entropy_reading += torch.stack([(out["entropy"].detach() * acted).sum(), acted.sum()])
                    if out.get("aux_loss") is not None:  # the routers' balance, the step's mean over micro-batches
                        aux_loss = out["aux_loss"] / len(micro_batches)
                        loss = loss + self.router_aux_loss_coef * aux_loss
                        sums["aux_loss"] += aux_loss.detach()  # logged as trained, as GRPOTrainer's
                    sums["loss"] += loss.detach()
                    self._backward(loss, last)
                    del out, loss  # this pass's activations go before the next pass makes its own
            if not last:
                self.control = self.callback_handler.on_substep_end(args, self.state, self.control)

        # A critic-only step leaves the policy's weights and optimizer state exactly as they are.
        policy_held = contextlib.nullcontext()
        if not trains_policy:
            if self.is_deepspeed_enabled:
                # ZeRO steps flat partitions, where a parameter's gradient cannot be cleared: hold its groups out.
                policy_held = groups_held_out(self.optimizer, "policy")
            else:
                # No gradient may reach the policy (DDP would hand it zeros that still tick Adam's step).
                for p in self.actor_critic.policy_parameters():
                    p.grad = None
        grad_norms = self._clip_gradients(trains_policy)
        step_loss, norms = sums["loss"].float(), [n.float().to(mask.device) for n in grad_norms.values()]
        # Over every process, so that every process skips, or none: a non-finite loss, the non-finite gradient norms
        # (fp16's loss scale may overflow them alone), and the tokens that train.
        nonfinite_norms = sum((~torch.isfinite(n)).float() for n in norms) if norms else torch.zeros_like(step_loss)
        counts = torch.stack([(~torch.isfinite(step_loss)).float(), nonfinite_norms, sums["_tokens"].float()])
        nonfinite_loss, nonfinite_grads, trained_tokens, entropy_sum, entropy_tokens = self._all_reduce(
            torch.cat([counts, entropy_reading])
        ).tolist()
        self._note_learning_rates()
        scaler = self.accelerator.scaler
        with policy_held:
            if nonfinite_loss == nonfinite_grads == 0 and trained_tokens > 0:
                self._apply_update()
                self.progress.consecutive_nonfinite_steps = 0
                if controls_entropy and entropy_tokens > 0:
                    self._control_entropy(entropy_sum / entropy_tokens)
            elif nonfinite_grads and nonfinite_loss == 0 and scaler is not None and scaler.get_scale() >= 1:
                self._skip_fp16_overflow(scaler)
            elif nonfinite_loss or nonfinite_grads:
                self._skip_nonfinite_step()
            else:
                self._skip_untrained_step()
        # Stepped on skipped steps too: the schedules count optimizer steps, and the actor's starts at a step number.
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if args.torch_empty_cache_steps and (self.state.global_step + 1) % args.torch_empty_cache_steps == 0:
            clear_device_cache()  # as transformers.Trainer: the allocator's cached blocks go back to the device

        self.state.global_step += 1
        self._record_step(sums, grad_norms, extremes)
        self._metrics["step_time"].append(time.perf_counter() - began)  # this process's, as GRPOTrainer's
        self.control = self.callback_handler.on_step_end(args, self.state, self.control)
        self._log_evaluate_save()

    def _no_sync_unless_each_batch(self):
        """The accelerator's `no_sync` (gradients left unreduced, for a later backward to reduce), but with
        accelerate's `sync_each_batch` (in accelerator_config's gradient_accumulation_kwargs): reduce every
        micro-batch's gradients, which spares DDP's and FSDP's unsharded accumulation its memory."""
        if self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
            return contextlib.nullcontext()
        return self.accelerator.no_sync(self.model_wrapped)

    @property
    def _backward_is_local(self) -> bool:
        """One process, no DeepSpeed, no FSDP: a backward is this process's own. Under DDP, DeepSpeed and FSDP it is
        a collective that expects one forward of the wrapped model before it (gradients reduced, shards gathered)."""
        from accelerate.utils import DistributedType

        return self.accelerator.distributed_type == DistributedType.NO

    def _update_passes(self, trains_policy: bool, learns_values: bool) -> list[tuple[bool, bool]]:
        """The (with_policy, with_values) forward-and-backward passes of one micro-batch.

        The policy's loss and the critic's depend on disjoint trainable weights (two adapters, or two models), so
        their sum's gradient is the sum of their gradients: one pass per side keeps one side's activations alive at a
        time (VAPO's LoRA peak was 1.17x GRPOTrainer's with both alive; issue 43). On one process, and under DDP that
        finds unused parameters (`_gradients_wait_for_the_step`: the step's last backward reduces what the others
        left under `no_sync`); under DeepSpeed and FSDP, whose backward is a collective that expects one forward of
        the whole model before it, one pass for both.
        """
        if trains_policy and learns_values and self._gradients_wait_for_the_step:
            return [(True, False), (False, True)]
        return [(trains_policy, learns_values)]

    def _loss_settings(self, phase: str, mask: torch.Tensor, is_positive: torch.Tensor) -> dict[str, Any]:
        """`core.vapo_loss`'s settings for a step over completions with this loss `mask` and `is_positive` (this
        process's share): its normalizers count the whole step, every process's micro-batches, divided by the number
        of processes (which DDP's gradient averaging, or the caller's sum over processes, multiplies back)."""
        args = self.args
        counts = torch.stack([mask.sum(), (mask.sum(dim=1) > 0).sum().float(), (mask * is_positive[:, None]).sum()])
        tokens, sequences, positive_tokens = (
            self._all_reduce(counts).clamp(min=1) / self.accelerator.num_processes
        ).unbind()
        return dict(
            epsilon_low=args.epsilon,
            epsilon_high=args.epsilon_high,
            loss_type=args.loss_type,
            nll_coef=args.nll_coef,
            vf_coef=args.vf_coef,
            delta=args.delta,
            entropy_coef=self._applied_entropy_coef() if phase == RL else 0.0,
            importance_sampling_level=args.importance_sampling_level,
            surrogate=args.surrogate,
            surrogate_params={
                "sapo_temperature_pos": args.sapo_temperature_pos,
                "sapo_temperature_neg": args.sapo_temperature_neg,
                "vespo_shape": (args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg),
            },
            normalizers={"tokens": tokens, "sequences": sequences, "positive_tokens": positive_tokens},
            # Value pretraining is plain regression on Monte-Carlo returns: no clipping around the rollout's values.
            cliprange_value=None if phase == VALUE_PRETRAIN else args.cliprange_value,
        )

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of one micro-batch; `last` marks the one that ends the optimizer step.

        The loss is already the step's mean (see `_optimizer_step`), so DeepSpeed must not divide it by the number of
        micro-batches; and DeepSpeed must be told which micro-batch ends the step, or it reduces and steps after every
        backward. The engine's own `step` runs later, in `_apply_update`, after the per-side clipping.
        """
        if self.is_deepspeed_enabled:
            engine = self.model_wrapped
            engine.set_gradient_accumulation_boundary(last)
            engine.backward(loss, scale_wrt_gas=False)
        else:
            self.accelerator.backward(loss)

    def _apply_update(self) -> None:
        """The optimizer's step, between the callbacks' `on_pre_optimizer_step` and `on_optimizer_step`, as the
        Trainer calls them around its step (an fp16 step the scaler skips included)."""
        self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)
        if self.is_deepspeed_enabled:
            self.model_wrapped.step()  # DeepSpeed's optimizer step; its own gradient clipping is off (`train`)
        else:
            self.optimizer.step()
        self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)

    def _drop_update(self) -> None:
        """No optimizer step this time (Adam's momentum and weight decay would move the weights even on zero
        gradients). DeepSpeed's engine must still close the step: NaN gradients make it skip the update and clear
        them itself. fp16's loss scaler closes its step too (its gradients were unscaled: `_clip_gradients`), at the
        same scale: what is skipped here is no overflow of the scale's. The callbacks' `on_pre_optimizer_step` and
        `on_optimizer_step` are called as around a step taken: the Trainer calls them at every step (a callback that
        counts optimizer steps counted fewer than `global_step`)."""
        self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)
        if self.is_deepspeed_enabled:  # (offloaded gradients already settled: `_clip_gradients`, this step)
            for params in (self.actor_critic.policy_parameters(), self.actor_critic.critic_parameters()):
                for fragment in deepspeed_local_gradients(params):
                    fragment.fill_(math.nan)
            mark_offload_overflow(self.optimizer)
            self.model_wrapped.step()
        elif self.accelerator.scaler is not None:
            self.accelerator.scaler.update(self.accelerator.scaler.get_scale())
        self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)
        self.progress.skipped_steps += 1

    def _skip_fp16_overflow(self, scaler) -> None:
        """fp16's loss scale overflowed a gradient (the loss is finite): the scaler skips the update and halves the
        scale, as it does under transformers' Trainer. Not a non-finite step: the first steps of a run calibrate the
        scale so. Once the scale is below 1, inf gradients are the model's own, and count (`_skip_nonfinite_step`)."""
        scale = scaler.get_scale()
        self._apply_update()  # the scaler's step: no update, the scale lowered
        self.progress.skipped_steps += 1
        logger.info(
            f"Step {self.state.global_step + 1}: fp16's loss scale {scale:g} overflowed a gradient; the update is "
            f"skipped and the scale is now {scaler.get_scale():g}."
        )

    def _skip_untrained_step(self) -> None:
        """Drop the update of a step in which no token trains: no completion in it was scored (or each scored one
        was truncated under `mask_truncated_completions`)."""
        self._drop_update()
        # (Under mask_truncated_completions the likelier cause early in a run: every completion cut at the length.)
        truncated = (
            ", or each one scored was truncated at max_completion_length (mask_truncated_completions=True)"
            if self.args.mask_truncated_completions
            else ""
        )
        logger.warning(
            f"Step {self.state.global_step + 1}: no completion in it was scored by {self.reward_func_names} (each "
            f"returned None){truncated}, so nothing trains; the update is skipped ({self.progress.skipped_steps} "
            "skipped so far)."
        )

    def _skip_nonfinite_step(self) -> None:
        """Drop this step's update (its loss or gradients are NaN/inf); stop after too many with no update applied
        between them (`consecutive_nonfinite_steps`, reset by an update: a step that trains nothing between two NaN
        steps does not make the model's NaNs go away)."""
        self._drop_update()
        progress = self.progress
        progress.consecutive_nonfinite_steps += 1
        logger.warning(
            f"Step {self.state.global_step + 1}: the loss or a gradient norm is NaN/inf; the update is skipped "
            f"({progress.skipped_steps} skipped so far)."
        )
        if progress.consecutive_nonfinite_steps >= self.args.nonfinite_loss_patience:
            last = ckpt.list_checkpoints(self.args.output_dir)
            where = f"the last checkpoint, {last[-1]}, is intact" if last else "no checkpoint was written yet"
            raise RuntimeError(
                f"{progress.consecutive_nonfinite_steps} optimizer steps since the last update applied had a NaN/inf "
                f"loss or gradient (step {self.state.global_step + 1}); stopping. {where}. Look for rewards or values "
                "of extreme magnitude, or lower learning_rate / critic_learning_rate."
            )

    def _clip_gradients(self, with_policy: bool) -> dict[str, torch.Tensor]:
        """Clip the actor's and the critic's gradients separately, so one side's spikes never shrink the other's."""
        norms = {}
        sides = [("critic", self.actor_critic.critic_parameters())] if self.actor_critic.learns_values else []
        if with_policy:
            sides.insert(0, ("policy", self.actor_critic.policy_parameters()))
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None
        fp16_scaled = self.accelerator.scaler is not None
        if fp16_scaled:  # unscaled once for both sides: accelerate's clipping unscales, and torch allows one a step
            self.accelerator.unscale_gradients()
        if self.is_deepspeed_enabled:
            settle_offloaded_gradients(self.optimizer)
        for side, params in sides:
            if self.is_deepspeed_enabled:
                norm = clip_deepspeed_gradients_(params, max_norm, self._all_reduce, self.accelerator.device)
            else:
                params = [p for p in params if p.grad is not None]
                if not params:
                    continue
                if max_norm is not None and fp16_scaled:
                    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                elif max_norm is not None:
                    norm = self.accelerator.clip_grad_norm_(params, max_norm)
                else:
                    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
            if norm is not None:
                if hasattr(norm, "full_tensor"):  # FSDP2 returns the norm of sharded gradients as a DTensor
                    norm = norm.full_tensor()
                norms[f"grad_norm/{side}"] = torch.as_tensor(norm).detach()
        return norms

    # ------------------------------------------------------------------------------- value pretraining
    def _after_value_pretrain_rollout(self, explained_var: float) -> None:
        """Count the rollout; end value pretraining at its budget or when explained variance stops improving."""
        args, progress = self.args, self.progress
        progress.value_pretrain_rollouts += 1
        progress.explained_variances.append(explained_var)
        stalled = args.value_pretrain_patience is not None and explained_variance_plateaued(
            progress.explained_variances, args.value_pretrain_patience, args.value_pretrain_min_delta
        )
        if progress.value_pretrain_rollouts >= args.value_pretrain_steps or stalled:
            self._finish_value_pretraining(
                early=stalled and progress.value_pretrain_rollouts < args.value_pretrain_steps
            )

    def _finish_value_pretraining(self, early: bool) -> None:
        progress = self.progress
        self._log_pending_metrics(VALUE_PRETRAIN)  # its last steps' readings since the last log: its own, not RL's
        progress.phase = RL
        progress.rl_start_step = self.state.global_step
        max_steps = self.run_plan.max_steps(progress)  # fewer when the stop rule ended value pretraining early
        self.state.num_train_epochs = self.run_plan.epochs(progress)
        if max_steps != self.state.max_steps:
            self.state.max_steps = max_steps
            self.state.compute_steps(self.args, max_steps)  # logging/eval/save_steps given as a share of the run
            for callback in self.callback_handler.callbacks:  # the bar: the console's, or a notebook's tracker
                for bar in (getattr(callback, "training_bar", None), getattr(callback, "training_tracker", None)):
                    if bar is not None:  # (ProgressCallback's tqdm bar, NotebookProgressCallback's tracker)
                        bar.total = self.state.max_steps
        self._replay = []
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, PhaseProgressCallback):
                callback.refresh()
        if self.is_deepspeed_enabled:  # see `trl_vapo.distributed`: a no-op unless something stepped the policy
            reset_adam_step(self.optimizer, "policy")
        start_actor_schedule(self.lr_scheduler, self.optimizer, progress.rl_start_step)
        set_critic_length(self.lr_scheduler, self.optimizer, self.state.max_steps)
        reason = "explained variance stopped improving" if early else "its budget is spent"
        final = progress.final_explained_variance(self.args.value_pretrain_patience)
        readings = progress.final_readings(self.args.value_pretrain_patience)
        logger.info(
            f"Value pretraining ended after {progress.value_pretrain_rollouts} rollouts ({reason}); explained "
            f"variance {'n/a' if math.isnan(final) else f'{final:.3f}'} (median of the last {readings} readings, each "
            "on a rollout before the critic's update on it). RL "
            f"starts at step {self.state.global_step}."
        )
        self._save_pretrained_critic()
        self._write_plots()

    # -------------------------------------------------------------------------------------------- metrics
    @property
    def _distributed(self) -> bool:
        return self.accelerator.num_processes > 1

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over processes (the tensor itself on one process)."""
        return self.accelerator.reduce(tensor, "sum") if self._distributed else tensor
