"""`VAPOTrainer`: the VAPO training loop on `transformers.Trainer`.

One iteration of the loop, top to bottom (`_train_on_rollout`):

1. take the next prompts and repeat each `num_generations` times (group sampling);
2. sample completions from the current policy (`_generate`);
3. score them with the reward functions; the sequence reward goes on the last valid token (`_score`);
4. compute old log-probs and old values once (and reference log-probs when `beta > 0`);
5. decoupled, length-adaptive GAE: advantages with per-sequence `lambda_actor`, critic targets with `lam_critic`
   (`lambda = 1` during value pretraining), optional whitening over the whole batch (`_make_rollout`);
6. `num_iterations` passes of shuffled optimizer steps, each a token-level clip-higher PPO loss plus the
   positive-example NLL for the policy and a clipped value loss for the critic (`_optimizer_step`).

Value pretraining is the same loop with the policy frozen and only the critic's loss, until `value_pretrain_steps`
rollouts or until explained variance stops improving. The math lives in `trl_vapo.core`; this file orchestrates.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import inspect
import json
import math
import os
import shutil
import textwrap
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, set_seed
from datasets import Dataset
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
)
from transformers.trainer_callback import ExportableState, ProgressCallback, TrainerState
from transformers.trainer_utils import TrainOutput, speed_metrics
from trl import is_conversational

from . import checkpoint as ckpt
from ._compat import (
    disable_dropout_in_model,
    generate_model_card,
    get_config_model_id,
    pad,
    unwrap_model_for_generation,
)
from .config import VAPOConfig
from .data import prompt_token_ids
from .distributed import (
    clip_deepspeed_gradients_,
    deepspeed_local_gradients,
    fsdp2_unsharded,
    full_state_dict,
    is_zero3_partitioned,
    reset_adam_step,
    whole_models_under_zero3,
)
from .core import (
    compute_gae,
    explained_variance,
    explained_variance_plateaued,
    length_adaptive_lambda,
    masked_mean,
    masked_whiten,
    policy_loss,
    positive_nll_loss,
    value_loss,
)
from .modeling import (
    CRITIC_ADAPTER,
    CRITIC_SUBFOLDER,
    POLICY_ADAPTER,
    VALUE_HEAD_FILE,
    VALUE_PRETRAINING_FILE,
    ActorCritic,
    ValueHead,
    check_value_model,
    completion_logprobs,
    critic_from_policy,
    generation_mode,
    is_peft_model,
    keep_trainable_weights_in_float32,
    policy_fingerprint,
    value_pretraining_record,
)

# Logs once, from the main process, however many processes train.
logger = get_logger(__name__)

RewardFunc = Callable[..., list[float | None]]

VALUE_PRETRAIN = "value_pretrain"
RL = "rl"
PRETRAINED_CRITIC_DIR = "value_pretrained_critic"
DEEPSPEED_CHECKPOINT_TAG = "deepspeed"


# ----------------------------------------------------------------------------------------------------------------------
# Small pieces of state
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainingProgress:
    """Where the run is, beyond `TrainerState`: saved in every checkpoint as `vapo_state.json`."""

    phase: str = VALUE_PRETRAIN
    value_pretrain_rollouts: int = 0
    explained_variances: list[float] = dataclasses.field(default_factory=list)  # one reading per pretraining rollout
    rl_start_step: int | None = None
    data_epoch: int = 0
    data_index: int = 0
    skipped_steps: int = 0
    consecutive_nonfinite_steps: int = 0

    @classmethod
    def from_dict(cls, saved: dict) -> TrainingProgress:
        # Checkpoints of earlier versions carry fields that no longer exist (the old stop rule's best reading).
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in saved.items() if key in known})

    def final_explained_variance(self, window: int | None) -> float:
        """The critic's explained variance at the end of value pretraining: the mean of the last finite readings."""
        finite = [r for r in self.explained_variances if math.isfinite(r)][-(window or 1) :]
        return sum(finite) / len(finite) if finite else math.nan


@dataclasses.dataclass
class Rollout:
    """One generation round on this process, everything the updates need, computed once (no gradients)."""

    input_ids: torch.Tensor  # [N, P + C] prompt (left-padded) followed by completion (right-padded)
    attention_mask: torch.Tensor  # [N, P + C]
    loss_mask: torch.Tensor  # [N, C] completion tokens that train (scored samples only)
    old_logprobs: torch.Tensor | None  # [N, C]; None when every sample trains on the policy that sampled it
    old_values: torch.Tensor  # [N, C]
    returns: torch.Tensor  # [N, C] critic targets
    advantages: torch.Tensor  # [N, C] (zeros during value pretraining)
    is_positive: torch.Tensor  # [N] bool
    prompt_length: int  # P

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def model_inputs(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`input_ids`, `attention_mask` and completion length of `rows`, without the padding all of them share."""
        attention = self.attention_mask[rows]
        first_prompt_column = int(attention[:, : self.prompt_length].any(dim=0).float().argmax())
        completion_length = max(int(attention[:, self.prompt_length :].sum(dim=1).max()), 1)
        end = self.prompt_length + completion_length
        return self.input_ids[rows, first_prompt_column:end], attention[:, first_prompt_column:end], completion_length

    def micro_batch(self, rows: torch.Tensor) -> dict[str, torch.Tensor | int | None]:
        """The model inputs of `rows` (see `model_inputs`) and their training targets, cut to the same length."""
        input_ids, attention_mask, length = self.model_inputs(rows)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "completion_length": length,
            "loss_mask": self.loss_mask[rows, :length],
            "old_logprobs": None if self.old_logprobs is None else self.old_logprobs[rows, :length],
            "old_values": self.old_values[rows, :length],
            "returns": self.returns[rows, :length],
            "advantages": self.advantages[rows, :length],
            "is_positive": self.is_positive[rows],
        }


class _Schedule:
    """Learning-rate multiplier for one parameter group, starting at optimizer step `start_step`.

    A callable object rather than a function so that `LambdaLR.state_dict()` saves `start_step` in checkpoints
    (the actor's schedule starts only when value pretraining ends). Formulas as in `transformers.get_scheduler`.
    """

    def __init__(self, kind: str, warmup_steps: int, total_steps: int, start_step: int | None = 0):
        self.kind = str(getattr(kind, "value", kind))  # a plain string: the state loads with weights_only=True
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.start_step = start_step

    def __call__(self, step: int) -> float:
        if self.start_step is None or step < self.start_step:
            return 0.0
        step -= self.start_step
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        if self.kind in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        if self.kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))  # cosine


# ----------------------------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------------------------


class VAPOTrainer(Trainer):
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
        reward_funcs: one reward function or a list, following TRL's protocol: called with keyword arguments
            `prompts`, `completions` (strings, or message lists for conversational data), `completion_ids`,
            `trainer_state` and every other dataset column (e.g. `answer`), it returns one float per completion, or
            `None` where it has no opinion. Rewards are summed with `args.reward_weights`; a completion no function
            scores is left out of the losses.
        args: a `VAPOConfig`.
        train_dataset: a `datasets.Dataset` with a `prompt` column (plain text or chat messages).
        processing_class: the tokenizer; loaded from `model` when omitted. Padding is set to the left.
        value_model: the critic. None (default) initialises it from the policy's weights with a fresh scalar head
            (with `peft_config`: a second adapter on the policy's frozen base). Or a path / model id of a value model
            (`AutoModelForSequenceClassification`, one label; or a critic folder saved by this trainer), or a
            `PreTrainedModel`. A critic saved by value pretraining skips that phase.
        callbacks: extra `TrainerCallback`s.
        optimizers: `(optimizer, lr_scheduler)` to use instead of AdamW with one parameter group per side.
        peft_config: a `peft.PeftConfig` (e.g. `LoraConfig(r=16)`) to train adapters instead of all weights.
    """

    _tag_names = ["trl", "trl-vapo", "vapo"]
    _name = "VAPO"
    _paper = {
        "title": "VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning Tasks",
        "id": "2504.05118",
        "citation": textwrap.dedent("""\
            @article{yue2025vapo,
                title   = {{VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning Tasks}},
                author  = {Yu Yue and Yufeng Yuan and Qiying Yu and Xiaochen Zuo and Ruofei Zhu and Wenyuan Xu and Jiaze Chen and Chengyi Wang and TianTian Fan and Zhengyin Du and Xiangpeng Wei and Xiangyu Yu and Gaohong Liu and Juncai Liu and Lingjun Liu and Haibin Lin and Zhiqi Lin and Bole Ma and Chi Zhang and Mofan Zhang and Wang Zhang and Hang Zhu and Ru Zhang and Xin Liu and Mingxuan Wang and Yonghui Wu and Lin Yan},
                year    = 2025,
                eprint  = {arXiv:2504.05118},
            }"""),
    }

    def __init__(
        self,
        model: str | PreTrainedModel | nn.Module,
        reward_funcs: RewardFunc | list[RewardFunc],
        args: VAPOConfig | None = None,
        train_dataset: Dataset | None = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        value_model: str | PreTrainedModel | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (None, None),
        peft_config: Any | None = None,
    ):
        if args is None:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = VAPOConfig(output_dir=f"{Path(str(name)).name or 'model'}-VAPO")
        if not isinstance(args, VAPOConfig):
            raise TypeError(f"args must be a VAPOConfig, got {type(args).__name__}.")

        self.reward_funcs, self.reward_func_names = _check_reward_funcs(reward_funcs)
        weights = args.reward_weights if args.reward_weights is not None else [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(weights)} values but there are {len(self.reward_funcs)} reward functions."
            )
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        _check_train_dataset(train_dataset, args)
        self._conversational = is_conversational({"prompt": train_dataset[0]["prompt"]})
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._warned_non_finite: set[str] = set()
        self._check_reward_funcs_on(train_dataset[0])

        # PEFT initialises adapters randomly: seed first so runs are reproducible.
        set_seed(args.seed)
        _check_quantization(args, peft_config)
        with whole_models_under_zero3(getattr(args, "hf_deepspeed_config", None)):
            policy, model_id = _load_policy(model, args)
        if is_zero3_partitioned(policy):
            raise ValueError(
                "The model was created partitioned by DeepSpeed ZeRO-3 (it was loaded after a ZeRO-3 VAPOConfig "
                "existed), so the critic cannot copy its weights. Pass the model id or path as `model`, or load the "
                "model before creating the VAPOConfig."
            )
        tokenizer = processing_class or AutoTokenizer.from_pretrained(
            model_id, trust_remote_code=args.trust_remote_code
        )
        _prepare_tokenizer(tokenizer)
        if self._conversational and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "The dataset's prompts are chat messages but the tokenizer has no chat template. Set "
                "`tokenizer.chat_template`, or use plain-text prompts."
            )

        quantized = getattr(policy, "is_loaded_in_4bit", False) or getattr(policy, "is_loaded_in_8bit", False)
        if quantized and peft_config is None and not is_peft_model(policy):
            raise ValueError(
                "The model is quantized (4-bit or 8-bit), and quantized weights cannot be trained: pass a peft_config "
                "(e.g. LoraConfig(r=16)) to train adapters on the frozen quantized base (QLoRA)."
            )
        if peft_config is not None and not is_peft_model(policy):
            from peft import get_peft_model, prepare_model_for_kbit_training

            if quantized:
                # Norms in float32 for stable QLoRA; checkpointing is switched on by `train`, adapter-aware.
                policy = prepare_model_for_kbit_training(policy, use_gradient_checkpointing=False)
            policy = get_peft_model(policy, peft_config)
        self._policy_fingerprint = policy_fingerprint(policy)
        with whole_models_under_zero3(getattr(args, "hf_deepspeed_config", None)):
            actor_critic, self._critic_pretrained = _build_actor_critic(
                policy, value_model, args, self._policy_fingerprint
            )
        if args.disable_dropout:
            disable_dropout_in_model(actor_critic)

        # With PEFT the reference policy is the base with adapters disabled; otherwise a frozen copy, only if used.
        self.ref_model = None
        if args.beta > 0 and not is_peft_model(policy):
            self.ref_model = copy.deepcopy(policy).eval().requires_grad_(False)
        if keep_trainable_weights_in_float32(actor_critic):
            logger.info(
                "Trainable weights were loaded in half precision; they are kept and updated in float32 "
                + ("and computed in bf16/fp16 under autocast." if args.bf16 or args.fp16 else "(set bf16=True to compute in bf16).")
            )

        super().__init__(
            model=actor_critic,
            args=args,
            train_dataset=train_dataset,
            processing_class=tokenizer,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != self.accelerator.num_processes:
            raise RuntimeError(
                f"Launched as {launched} processes (WORLD_SIZE) but training is set up for "
                f"{self.accelerator.num_processes}: the processes would train separately on the same output_dir. "
                "Launch with `accelerate launch` or `torchrun`, and pass use_cpu=True on a machine without GPUs."
            )
        if args.fsdp and self.accelerator.distributed_type != DistributedType.FSDP:
            logger.warning(
                f"FSDP was asked for (fsdp={args.fsdp}) but accelerate set up {self.accelerator.distributed_type}: it "
                "enables FSDP only on GPUs (on CPUs it runs plain data parallelism). The model is not sharded."
            )
        if self.is_deepspeed_enabled:
            sections = [k for k in ("optimizer", "scheduler") if k in self.accelerator.state.deepspeed_plugin.deepspeed_config]
            if sections:
                raise ValueError(
                    f"The DeepSpeed config has {' and '.join(sections)} section(s): VAPOTrainer builds its own AdamW with "
                    "separate actor and critic parameter groups, learning rates and schedules. Remove them and set "
                    "learning_rate, critic_learning_rate, lr_scheduler_type and warmup_steps in VAPOConfig instead."
                )
        if self.ref_model is not None:
            self.ref_model.to(self.accelerator.device)

        eos_ids = _eos_token_ids(tokenizer, policy)
        generation_kwargs = {
            "max_new_tokens": args.max_completion_length,
            "do_sample": True,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "repetition_penalty": args.repetition_penalty,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": eos_ids,
            "bos_token_id": None,
            "use_cache": True,
            **(args.generation_kwargs or {}),
        }
        if args.min_p is not None:
            generation_kwargs["min_p"] = args.min_p
        self.generation_config = GenerationConfig(**generation_kwargs, disable_compile=True)
        off_policy = _off_policy_sampling_settings(self.generation_config, policy, args.temperature)
        if off_policy:
            logger.warning(
                f"Rollouts are sampled with {', '.join(off_policy)}, which the losses do not model: log-probabilities "
                f"are computed from softmax(logits / {args.temperature}) alone, so the samples are off-policy and the "
                "PPO ratio and the positive-example NLL are biased. Train with plain temperature sampling (top_p=1.0, "
                "top_k=0, min_p=None, repetition_penalty=1.0); evaluate with top-p if you like (`trl-vapo eval`)."
            )
        # `generation_kwargs` may name other stop tokens: a completion ends at whichever generation stopped on.
        stop = self.generation_config.eos_token_id
        self._eos_ids = torch.tensor(stop if isinstance(stop, list) else [stop])

        self.progress = TrainingProgress(phase=RL if self._skips_value_pretraining else VALUE_PRETRAIN)
        self._save_pending = False
        self._handle_long_prompts()
        # Each process samples different completions even for the same prompt (as TRL's GRPOTrainer does).
        set_seed(args.seed, device_specific=True)

    # ------------------------------------------------------------------------------------------------ setup
    @property
    def _skips_value_pretraining(self) -> bool:
        return self.args.value_pretrain_steps == 0 or self._critic_pretrained

    @property
    def actor_critic(self) -> ActorCritic:
        return self.model

    def _plan(self) -> dict[str, int]:
        """Step counts of the run: RL optimizer steps, plus at most this many value-pretraining steps."""
        args = self.args
        prompts_per_rollout = args.generation_batch_size // args.num_generations
        rollouts_per_epoch = len(self.train_dataset) // prompts_per_rollout
        updates_per_rollout = args.num_iterations * args.steps_per_generation // args.gradient_accumulation_steps
        if args.max_steps > 0:
            rl_steps = args.max_steps
        else:
            rl_steps = math.ceil(args.num_train_epochs * rollouts_per_epoch) * updates_per_rollout
        pretrain_rollouts = 0 if self._skips_value_pretraining else args.value_pretrain_steps
        return {
            "prompts_per_rollout": prompts_per_rollout,
            "updates_per_rollout": updates_per_rollout,
            "rl_steps": rl_steps,
            "pretrain_steps": pretrain_rollouts * updates_per_rollout,
        }

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """AdamW (or `args.optim`) with separate parameter groups, and learning rates, for the actor and critic."""
        if self.optimizer is not None:
            return self.optimizer
        args = self.args
        decay = set(self.get_decay_parameter_names(self.model))
        names = {id(p): n for n, p in self.model.named_parameters()}
        groups = []
        for side, params, lr in (
            ("policy", self.actor_critic.policy_parameters(), args.learning_rate),
            ("critic", self.actor_critic.critic_parameters(), args.critic_learning_rate),
        ):
            for with_decay in (True, False):
                selected = [p for p in params if (names[id(p)] in decay) == with_decay]
                if selected:
                    groups.append(
                        {"params": selected, "lr": lr, "weight_decay": args.weight_decay if with_decay else 0.0, "name": side}
                    )
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(args, self.model)
        optimizer_kwargs.pop("lr", None)
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """Per-group schedules: the critic's runs from step 0, the actor's from its first update (after value
        pretraining), each with `lr_scheduler_type` and warm-up over its own number of steps."""
        if self.lr_scheduler is not None:
            return self.lr_scheduler
        plan = self._plan()
        optimizer = optimizer or self.optimizer
        actor_start = 0 if self._skips_value_pretraining else None
        schedules = []
        for group in optimizer.param_groups:
            # Groups of a user-built optimizer without a "name" follow the critic's schedule: never held at zero.
            if group.get("name") == "policy":
                total = plan["rl_steps"]
                schedules.append(
                    _Schedule(self.args.lr_scheduler_type, self.args.get_warmup_steps(total), total, actor_start)
                )
            else:
                total = plan["pretrain_steps"] + plan["rl_steps"]
                schedules.append(_Schedule(self.args.lr_scheduler_type, self.args.get_warmup_steps(total), total))
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
        return self.lr_scheduler

    # -------------------------------------------------------------------------------------------- training
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs) -> TrainOutput:
        """Run value pretraining (unless skipped) then VAPO; `resume_from_checkpoint` continues a saved run."""
        args = self.args
        self.is_in_train = True
        if resume_from_checkpoint is True:
            found = ckpt.list_checkpoints(args.output_dir)
            if not found:
                raise ValueError(f"resume_from_checkpoint=True but no complete checkpoint in {args.output_dir}.")
            resume_from_checkpoint = found[-1]
        plan = self._plan()

        self.state = TrainerState(
            stateful_callbacks=[
                cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)
            ]
        )
        self.state.max_steps = plan["pretrain_steps"] + plan["rl_steps"]
        self.state.num_train_epochs = math.ceil(args.num_train_epochs) if args.max_steps <= 0 else 1
        self.state.compute_steps(args, self.state.max_steps)
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.state.is_world_process_zero = self.is_world_process_zero()
        self.state.train_batch_size = args.per_device_train_batch_size

        self.create_optimizer()
        self.create_scheduler(self.state.max_steps)
        if args.gradient_checkpointing:
            self.actor_critic.gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)
        if self.is_deepspeed_enabled:
            # Actor and critic are clipped separately in `_clip_gradients`; DeepSpeed would clip their joint norm.
            self.accelerator.state.deepspeed_plugin.deepspeed_config["gradient_clipping"] = 0.0
        if not self._skips_value_pretraining and args.ddp_find_unused_parameters is not False:
            # Value pretraining leaves the policy out of the forward pass; DDP must expect unused parameters.
            handler = self.accelerator.ddp_handler or DistributedDataParallelKwargs()
            handler.find_unused_parameters = True
            self.accelerator.ddp_handler = handler
        self.model_wrapped, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))

        if resume_from_checkpoint is not None:
            self._load_checkpoint(Path(resume_from_checkpoint))

        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        start_time = time.time()
        start_step = self.state.global_step
        self._loss_sum, self._loss_steps = 0.0, 0
        self.model_wrapped.train()
        while self.state.global_step < self.state.max_steps and not self.control.should_training_stop:
            self._train_on_rollout()

        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        metrics = speed_metrics("train", start_time, num_steps=self.state.global_step - start_step)
        train_loss = self._loss_sum / max(self._loss_steps, 1)
        metrics["train_loss"] = train_loss
        self.log(dict(metrics))
        self.is_in_train = False
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def _train_on_rollout(self) -> None:
        args = self.args
        phase = self.progress.phase
        rows = self._next_rows()
        rollout, metrics = self._make_rollout(rows, phase)
        self._record(metrics)

        rows_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        steps = (rows for _ in range(args.num_iterations) for rows in torch.randperm(len(rollout)).split(rows_per_step))
        for step_rows in steps:
            self._optimizer_step(rollout, step_rows, phase)
            if self.state.global_step >= self.state.max_steps or self.control.should_training_stop:
                break

        if phase == VALUE_PRETRAIN:
            self._after_value_pretrain_rollout(metrics["value/explained_variance"])
        if self._save_pending:
            self._save_checkpoint()
            self._save_pending = False

    def _next_rows(self) -> list[dict[str, Any]]:
        """This process's share of the next rollout: each prompt repeated `num_generations` times."""
        args = self.args
        dataset = self.train_dataset
        count = args.generation_batch_size // args.num_generations
        if self.progress.data_index + count > len(dataset):
            self.progress.data_epoch += 1
            self.progress.data_index = 0
        order = self._epoch_order()
        indices = order[self.progress.data_index : self.progress.data_index + count].tolist()
        self.progress.data_index += count
        self.state.epoch = self.progress.data_epoch + self.progress.data_index / len(dataset)

        columns = dataset[indices]
        prompts = [dict(zip(columns, values)) for values in zip(*columns.values())]
        repeated = [row for row in prompts for _ in range(args.num_generations)]
        per_process = args.generation_batch_size // self.accelerator.num_processes
        start = self.accelerator.process_index * per_process
        return repeated[start : start + per_process]

    def _epoch_order(self) -> torch.Tensor:
        """The order of the prompts in the current epoch: a permutation seeded by the epoch, the same on every
        process and after a resume."""
        epoch = self.progress.data_epoch
        if getattr(self, "_order", (None, None))[0] != epoch:
            size = len(self.train_dataset)
            if self.args.shuffle_dataset:
                generator = torch.Generator().manual_seed((self.args.data_seed or self.args.seed) + epoch)
                self._order = (epoch, torch.randperm(size, generator=generator))
            else:
                self._order = (epoch, torch.arange(size))
        return self._order[1]

    # ------------------------------------------------------------------------------------ rollout: sampling
    def _tokenize_prompts(self, prompts: list, truncate: bool = True) -> list[list[int]]:
        """Token ids of the prompts (chat template applied to chat prompts), cut to their last `max_prompt_length`."""
        ids = prompt_token_ids(self.processing_class, prompts, self._conversational, self.args.chat_template_kwargs)
        limit = self.args.max_prompt_length
        if truncate and limit is not None:
            ids = [x[-limit:] for x in ids]
        return ids

    def _handle_long_prompts(self) -> None:
        """Count the prompts longer than `max_prompt_length` once, before training: drop them or warn once."""
        limit = self.args.max_prompt_length
        if limit is None:
            return
        dataset = self.train_dataset
        lengths = []
        for start in range(0, len(dataset), 1000):
            lengths += [len(x) for x in self._tokenize_prompts(dataset[start : start + 1000]["prompt"], truncate=False)]
        long = [i for i, n in enumerate(lengths) if n > limit]
        if not long:
            return
        if self.args.drop_long_prompts:
            keep = sorted(set(range(len(dataset))) - set(long))
            self.train_dataset = dataset.select(keep)
            logger.warning(
                f"Dropped {len(long)} of {len(dataset)} training prompts longer than max_prompt_length={limit} tokens "
                f"(longest: {max(lengths)})."
            )
            _check_train_dataset(self.train_dataset, self.args)
        else:
            logger.warning(
                f"{len(long)} of {len(dataset)} training prompts are longer than max_prompt_length={limit} tokens "
                f"(longest: {max(lengths)}); they are truncated from the left. Raise max_prompt_length to keep them "
                "whole, or set drop_long_prompts=True to leave them out."
            )

    @torch.no_grad()
    def _generate(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample one completion per prompt. Returns left-padded prompts with their mask, and completions cut after
        the first EOS (right-padded with the pad token)."""
        device = self.accelerator.device
        tokenizer = self.processing_class
        prompts = pad([torch.tensor(x) for x in prompt_ids], padding_value=tokenizer.pad_token_id, padding_side="left")
        prompt_mask = pad([torch.ones(len(x), dtype=torch.long) for x in prompt_ids], padding_side="left")
        prompts, prompt_mask = prompts.to(device), prompt_mask.to(device)
        with (
            unwrap_model_for_generation(
                self.model_wrapped, self.accelerator,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped,
            fsdp2_unsharded(self.model_wrapped),
        ):
            with generation_mode(unwrapped), self.accelerator.autocast():
                output = unwrapped.policy.generate(
                    input_ids=prompts, attention_mask=prompt_mask, generation_config=self.generation_config,
                    tokenizer=tokenizer,  # needed for `stop_strings`
                )
        completions = output[:, prompts.shape[1] :]
        if completions.shape[1] == 0:  # every sequence ended at once
            completions = torch.full((len(prompt_ids), 1), tokenizer.pad_token_id, device=device)
        completions, completion_mask = cut_completions(
            completions, self._eos_ids.to(device), tokenizer.pad_token_id, bool(self.generation_config.stop_strings)
        )
        return prompts, prompt_mask, completions, completion_mask

    # ------------------------------------------------------------------------------------- rollout: rewards
    def _score(self, rows: list[dict], completion_ids: list[list[int]]) -> torch.Tensor:
        """`[N, num_funcs]` rewards, NaN where a function returned None (or a non-finite value)."""
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if self._conversational else texts
        scores = torch.full((len(rows), len(self.reward_funcs)), math.nan)
        for j, (func, name) in enumerate(zip(self.reward_funcs, self.reward_func_names)):
            values = self._call_reward(func, name, rows, completions, completion_ids)
            column = torch.tensor([math.nan if v is None else float(v) for v in values])
            non_finite = torch.isinf(column) | (torch.isnan(column) & torch.tensor([v is not None for v in values]))
            if non_finite.any():
                self._metrics[f"rewards/{name}/non_finite_count"].append(float(non_finite.sum()))
                if name not in self._warned_non_finite:
                    logger.warning(
                        f"Reward function {name!r} returned NaN or inf for {int(non_finite.sum())} of {len(rows)} "
                        f"completions; they are treated like None (left out unless another function scores them) "
                        f"and counted in `rewards/{name}/non_finite_count`."
                    )
                    self._warned_non_finite.add(name)
                column[non_finite] = math.nan
            scores[:, j] = column
        return scores

    def _call_reward(self, func, name, rows, completions, completion_ids) -> list:
        prompts = [row["prompt"] for row in rows]
        columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
        log_metric = lambda key, value: self._metrics[key].append(float(value))  # noqa: E731
        try:
            values = func(
                prompts=prompts, completions=completions, completion_ids=completion_ids,
                trainer_state=getattr(self, "state", None), log_metric=log_metric, **columns,
            )
        except Exception as error:
            # Find the first sample it fails on, so the message can show it.
            for i in range(len(rows)):
                try:
                    func(
                        prompts=prompts[i : i + 1], completions=completions[i : i + 1],
                        completion_ids=completion_ids[i : i + 1], trainer_state=getattr(self, "state", None),
                        log_metric=log_metric,
                        **{key: value[i : i + 1] for key, value in columns.items()},
                    )
                except Exception:
                    sample = {"prompt": prompts[i], "completion": completions[i], **{k: v[i] for k, v in columns.items()}}
                    raise RuntimeError(
                        f"Reward function {name!r} raised {type(error).__name__}: {error} -- first failing sample "
                        f"(#{i} of the batch): {_preview(sample)}"
                    ) from error
            raise RuntimeError(f"Reward function {name!r} raised {type(error).__name__} on the batch: {error}") from error
        if values is None or len(values) != len(rows):
            raise ValueError(
                f"Reward function {name!r} returned {None if values is None else len(values)} values for "
                f"{len(rows)} completions; it must return one float (or None) per completion."
            )
        return values

    def _check_reward_funcs_on(self, row: dict) -> None:
        """Call every reward function once on a dataset row with an empty completion, before any compute.

        A missing column, a bad import or a crash then fails here, with the dataset's columns in the message, not
        after the model has loaded and generated.
        """
        completions = [[{"role": "assistant", "content": ""}]] if self._conversational else [""]
        for func, name in zip(self.reward_funcs, self.reward_func_names):
            missing = [c for c in _required_columns(func) if c not in row]
            if missing:
                raise ValueError(
                    f"Reward function {name!r} needs the column(s) {missing}, which the training dataset lacks; its "
                    f"columns are {sorted(row)}."
                )
            try:
                self._call_reward(func, name, [row], completions, [[]])
            except RuntimeError as error:
                raise ValueError(
                    f"{error} (checked before training on the first dataset row with an empty completion; dataset "
                    f"columns: {sorted(row)})"
                ) from error

    # --------------------------------------------------------------------------- rollout: old stats and GAE
    @torch.no_grad()
    def _make_rollout(self, rows: list[dict], phase: str) -> tuple[Rollout, dict[str, float]]:
        args = self.args
        device = self.accelerator.device
        prompt_ids = self._tokenize_prompts([row["prompt"] for row in rows])
        prompts, prompt_mask, completions, completion_mask = self._generate(prompt_ids)
        completion_lists = [c[m.bool()].tolist() for c, m in zip(completions, completion_mask)]
        lengths = completion_mask.sum(dim=1)
        # Cut by the length limit, not ended by a stop token (or a stop string, which leaves no stop token).
        truncated = ~torch.isin(completions, self._eos_ids.to(device)).any(dim=1) & (lengths >= args.max_completion_length)

        scores = self._score(rows, completion_lists).to(device)
        weighted = scores * self.reward_weights.to(device)
        scored = ~torch.isnan(scores).all(dim=1)
        sequence_reward = torch.where(scored, torch.nansum(weighted, dim=1), torch.zeros_like(weighted[:, 0]))
        trains = scored & (lengths > 0)
        if args.mask_truncated_completions:
            trains &= ~truncated

        mask = completion_mask.float() * trains[:, None].float()
        rollout = Rollout(
            input_ids=torch.cat([prompts, completions], dim=1),
            attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
            loss_mask=mask,
            old_logprobs=None,
            old_values=torch.zeros_like(mask),
            returns=torch.zeros_like(mask),
            advantages=torch.zeros_like(mask),
            is_positive=torch.zeros_like(trains),
            prompt_length=prompts.shape[1],
        )
        old_logprobs, old_values, ref_logprobs = self._score_tokens(rollout, with_policy=self._needs_old_logprobs(phase))

        # The verifier's score lands on the last valid token of each completion.
        token_rewards = torch.zeros_like(mask)
        token_rewards[torch.arange(len(rows), device=device), (lengths - 1).clamp(min=0)] = sequence_reward * trains
        if ref_logprobs is not None:
            token_rewards = token_rewards - args.beta * (old_logprobs - ref_logprobs) * mask

        all_reduce = self._all_reduce_sum if self.accelerator.num_processes > 1 else None
        lam_critic = 1.0 if phase == VALUE_PRETRAIN else args.lam_critic  # value pretraining: Monte-Carlo returns
        _, returns = compute_gae(token_rewards, old_values, mask, args.gamma, lam_critic)
        if args.length_adaptive_alpha is not None:
            lam_actor = length_adaptive_lambda(lengths, args.length_adaptive_alpha).to(device)
        else:
            lam_actor = torch.full((len(rows),), args.lam_actor, device=device)
        if phase == RL:
            raw_advantages, _ = compute_gae(token_rewards, old_values, mask, args.gamma, lam_actor)
            advantages = masked_whiten(raw_advantages, mask, all_reduce=all_reduce) if args.whiten_advantages else raw_advantages
        else:
            raw_advantages = advantages = torch.zeros_like(mask)
        is_positive = trains & (sequence_reward >= args.positive_reward_threshold)
        rollout.old_logprobs, rollout.old_values, rollout.returns = old_logprobs, old_values, returns
        rollout.advantages, rollout.is_positive = advantages, is_positive
        metrics = self._rollout_metrics(
            scores, sequence_reward, scored, trains, is_positive, lengths, truncated, mask, old_values, returns,
            raw_advantages, lam_actor, old_logprobs, ref_logprobs, all_reduce,
        )
        return rollout, metrics

    def _needs_old_logprobs(self, phase: str) -> bool:
        """Whether the updates need log-probs from before the first update of the rollout.

        With one optimizer step per rollout and one pass over it, each sample trains the policy that sampled it: the
        old log-probs equal the update's own (detached), so the extra forward pass is skipped, as in TRL's
        GRPOTrainer. The KL penalty (`beta > 0`) always needs them.
        """
        args = self.args
        if args.beta > 0:
            return True
        return phase == RL and (args.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps)

    def _score_tokens(self, rollout: Rollout, with_policy: bool):
        """Old log-probs (when `with_policy`) and values, and reference log-probs when beta > 0, computed in
        micro-batches without gradients and padded back to the rollout's width."""
        model = self.actor_critic
        args = self.args
        width = rollout.loss_mask.shape[1]
        logprobs = torch.zeros_like(rollout.loss_mask) if with_policy else None
        values = torch.zeros_like(rollout.loss_mask)
        ref = torch.zeros_like(rollout.loss_mask) if args.beta > 0 else None
        for rows in torch.arange(len(rollout)).split(args.per_device_train_batch_size):
            ids, attention, length = rollout.model_inputs(rows)
            columns = slice(0, min(length, width))
            with self.accelerator.autocast():
                out = model(ids, attention, length, args.temperature, with_policy=with_policy, with_entropy=False)
                values[rows, columns] = out["values"]
                if with_policy:
                    logprobs[rows, columns] = out["logprobs"]
                if ref is not None:
                    reference = self.ref_model if self.ref_model is not None else model.policy
                    adapters_off = model.policy.disable_adapter() if self.ref_model is None else contextlib.nullcontext()
                    with adapters_off:
                        ref[rows, columns] = completion_logprobs(reference, ids, attention, length, args.temperature)
        return logprobs, values, ref

    def _rollout_metrics(
        self, scores, sequence_reward, scored, trains, is_positive, lengths, truncated, mask, old_values, returns,
        raw_advantages, lam_actor, old_logprobs, ref_logprobs, all_reduce,
    ) -> dict[str, float]:
        gather = self.accelerator.gather
        scores_all = gather(scores)
        reward_all = gather(sequence_reward)
        scored_all = gather(scored)
        lengths_all = gather(lengths).float()
        trains_all = gather(trains)
        rewards = reward_all[scored_all]
        metrics = {
            "reward": _mean(rewards),
            "reward_std": _std(rewards),
            "accuracy": _mean(gather(is_positive)[scored_all].float()),
            "positive_fraction": _mean(gather(is_positive)[trains_all].float()),
            "rewards/unscored_fraction": 1.0 - scored_all.float().mean().item(),
            "completions/mean_length": lengths_all.mean().item(),
            "completions/min_length": lengths_all.min().item(),
            "completions/max_length": lengths_all.max().item(),
            "completions/clipped_ratio": gather(truncated).float().mean().item(),
            "value/mean": _global_masked_mean(old_values, mask, all_reduce),
            "value/explained_variance": explained_variance(old_values, returns, mask, all_reduce=all_reduce).item(),
            "advantages/mean": _global_masked_mean(raw_advantages, mask, all_reduce),
            "lambda_actor/mean": _mean(gather(lam_actor)[trains_all]),
        }
        for j, name in enumerate(self.reward_func_names):
            column = scores_all[:, j]
            column = column[~torch.isnan(column)]
            metrics[f"rewards/{name}/mean"] = _mean(column)
            metrics[f"rewards/{name}/std"] = _std(column)
        if ref_logprobs is not None:
            metrics["kl"] = _global_masked_mean(old_logprobs - ref_logprobs, mask, all_reduce)
        return metrics

    # ----------------------------------------------------------------------------------------- the update
    def _optimizer_step(self, rollout: Rollout, rows: torch.Tensor, phase: str) -> None:
        """One optimizer step over `rows` of the rollout, split into `gradient_accumulation_steps` micro-batches.

        The token mean spans the whole step: every micro-batch's loss is divided by the step's token count summed
        over micro-batches and processes (times the process count, which DDP's gradient averaging divides back).
        """
        args = self.args
        world = self.accelerator.num_processes
        mask = rollout.loss_mask[rows]
        counts = torch.stack(
            [mask.sum(), (mask.sum(dim=1) > 0).sum().float(), (mask * rollout.is_positive[rows, None].float()).sum()]
        )
        tokens, sequences, positive_tokens = (self._all_reduce_sum(counts).clamp(min=1) / world).unbind()
        policy_normalizer = tokens if args.loss_type == "token" else sequences

        self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=mask.device))
        micro_batches = rows.split(args.per_device_train_batch_size)
        # Value pretraining is plain regression on Monte-Carlo returns: no clipping around the rollout's values.
        cliprange_value = args.cliprange_value if phase == RL else None
        for i, micro_rows in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last or self.is_deepspeed_enabled else self.accelerator.no_sync(self.model_wrapped)
            batch = rollout.micro_batch(micro_rows)
            with sync:
                with self.accelerator.autocast():
                    out = self.model_wrapped(
                        batch["input_ids"],
                        batch["attention_mask"],
                        batch["completion_length"],
                        args.temperature,
                        with_policy=phase == RL,
                    )
                micro_mask = batch["loss_mask"]
                v_loss, v_stats = value_loss(
                    out["values"], batch["old_values"], batch["returns"], micro_mask, cliprange_value, tokens
                )
                loss = args.vf_coef * v_loss
                sums["loss/value"] += v_loss.detach()
                n = micro_mask.sum()
                sums["value/clip_ratio"] += v_stats["vf_clip_frac"] * n
                if phase == RL:
                    old_logprobs = batch["old_logprobs"] if batch["old_logprobs"] is not None else out["logprobs"].detach()
                    pg_loss, pg_stats = policy_loss(
                        out["logprobs"], old_logprobs, batch["advantages"], micro_mask,
                        args.epsilon, args.epsilon_high, args.loss_type, policy_normalizer,
                    )
                    loss = loss + pg_loss
                    sums["loss/policy"] += pg_loss.detach()
                    if args.nll_coef > 0:
                        nll = positive_nll_loss(out["logprobs"], micro_mask, batch["is_positive"], positive_tokens)
                        loss = loss + args.nll_coef * nll
                        sums["loss/nll"] += nll.detach()
                    for key, name in (
                        ("clip_frac_low", "clip_ratio/low_mean"),
                        ("clip_frac_high", "clip_ratio/high_mean"),
                        ("clip_frac", "clip_ratio/region_mean"),
                        ("approx_kl", "approx_kl"),
                    ):
                        sums[name] += pg_stats[key] * n
                    sums["entropy"] += masked_mean(out["entropy"], micro_mask) * n
                sums["loss"] += loss.detach()
                sums["_tokens"] += n
                self._backward(loss, last)
            if not last:
                self.control = self.callback_handler.on_substep_end(args, self.state, self.control)

        if phase == VALUE_PRETRAIN and not self.is_deepspeed_enabled:
            # The policy is frozen: no gradient may reach it (DDP would hand it zeros that still tick Adam's step).
            for p in self.actor_critic.policy_parameters():
                p.grad = None
        grad_norms = self._clip_gradients(phase)
        checks = torch.stack([sums["loss"].float(), *(n.float().to(mask.device) for n in grad_norms.values())])
        nonfinite = self._all_reduce_sum((~torch.isfinite(checks)).sum().float())  # every process skips, or none
        self._step_learning_rates = {group.get("name"): group["lr"] for group in self.optimizer.param_groups}
        if nonfinite.item() == 0:
            self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
            self._apply_update()
            self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
            self.progress.consecutive_nonfinite_steps = 0
        else:
            self._skip_nonfinite_step()
        # Stepped on skipped steps too: the schedules count optimizer steps, and the actor's starts at a step number.
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

        self.state.global_step += 1
        self._record_step(sums, grad_norms, phase)
        self.control = self.callback_handler.on_step_end(args, self.state, self.control)
        if self.control.should_log:
            self._log_metrics(phase)
        self._save_pending |= self.control.should_save

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
        if self.is_deepspeed_enabled:
            self.model_wrapped.step()  # DeepSpeed's optimizer step; its own gradient clipping is off (`train`)
        else:
            self.optimizer.step()

    def _skip_nonfinite_step(self) -> None:
        """Drop this step's update (its loss or gradients are NaN/inf); stop after too many in a row."""
        if self.is_deepspeed_enabled:
            # The engine must still close the step; NaN gradients make it skip the update and clear them itself.
            for params in (self.actor_critic.policy_parameters(), self.actor_critic.critic_parameters()):
                for fragment in deepspeed_local_gradients(params):
                    fragment.fill_(math.nan)
            self.model_wrapped.step()
        progress = self.progress
        progress.skipped_steps += 1
        progress.consecutive_nonfinite_steps += 1
        logger.warning(
            f"Step {self.state.global_step + 1}: the loss or a gradient norm is NaN/inf; the update is skipped "
            f"({progress.skipped_steps} skipped so far)."
        )
        if progress.consecutive_nonfinite_steps >= self.args.nonfinite_loss_patience:
            last = ckpt.list_checkpoints(self.args.output_dir)
            where = f"the last checkpoint, {last[-1]}, is intact" if last else "no checkpoint was written yet"
            raise RuntimeError(
                f"{progress.consecutive_nonfinite_steps} optimizer steps in a row had a NaN/inf loss or gradient "
                f"(step {self.state.global_step + 1}); stopping. {where}. Look for rewards or values of extreme "
                "magnitude, or lower learning_rate / critic_learning_rate."
            )

    def _clip_gradients(self, phase: str) -> dict[str, torch.Tensor]:
        """Clip the actor's and the critic's gradients separately, so one side's spikes never shrink the other's."""
        norms = {}
        sides = [("critic", self.actor_critic.critic_parameters())]
        if phase == RL:
            sides.insert(0, ("policy", self.actor_critic.policy_parameters()))
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None
        for side, params in sides:
            if self.is_deepspeed_enabled:
                norm = clip_deepspeed_gradients_(params, max_norm, self._all_reduce_sum)
            else:
                params = [p for p in params if p.grad is not None]
                if not params:
                    continue
                if max_norm is not None:
                    norm = self.accelerator.clip_grad_norm_(params, max_norm)
                else:
                    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
            if norm is not None:
                if hasattr(norm, "full_tensor"):  # FSDP2 returns the norm of sharded gradients as a DTensor
                    norm = norm.full_tensor()
                norms[f"grad_norm/{side}"] = torch.as_tensor(norm).detach()
        return norms

    def _after_value_pretrain_rollout(self, explained_var: float) -> None:
        """Count the rollout; end value pretraining at its budget or when explained variance stops improving."""
        args, progress = self.args, self.progress
        progress.value_pretrain_rollouts += 1
        progress.explained_variances.append(explained_var)
        stalled = args.value_pretrain_patience is not None and explained_variance_plateaued(
            progress.explained_variances, args.value_pretrain_patience, args.value_pretrain_min_delta
        )
        if progress.value_pretrain_rollouts >= args.value_pretrain_steps or stalled:
            self._finish_value_pretraining(early=stalled and progress.value_pretrain_rollouts < args.value_pretrain_steps)

    def _finish_value_pretraining(self, early: bool) -> None:
        progress = self.progress
        updates_per_rollout = self._plan()["updates_per_rollout"]
        unused = (self.args.value_pretrain_steps - progress.value_pretrain_rollouts) * updates_per_rollout
        if unused > 0:
            self.state.max_steps -= unused
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
                    callback.training_bar.total = self.state.max_steps
                    callback.training_bar.refresh()
        progress.phase = RL
        progress.rl_start_step = self.state.global_step
        if self.is_deepspeed_enabled:
            reset_adam_step(self.optimizer, "policy")
        scheduler = self.lr_scheduler
        schedules = getattr(scheduler, "lr_lambdas", [])  # a user's own scheduler is left alone
        for group, schedule, base_lr in zip(self.optimizer.param_groups, schedules, scheduler.base_lrs):
            if group.get("name") == "policy" and isinstance(schedule, _Schedule):
                schedule.start_step = progress.rl_start_step
                # LambdaLR computed this step's rate before the actor's schedule started: recompute it.
                group["lr"] = base_lr * schedule(scheduler.last_epoch)
        reason = "explained variance stopped improving" if early else "its budget is spent"
        final = progress.final_explained_variance(self.args.value_pretrain_patience)
        logger.info(
            f"Value pretraining ended after {progress.value_pretrain_rollouts} rollouts ({reason}); explained "
            f"variance {'n/a' if math.isnan(final) else f'{final:.3f}'} (mean of the last readings). RL starts at "
            f"step {self.state.global_step}."
        )
        self._save_pretrained_critic()

    def _save_pretrained_critic(self) -> None:
        """Save the critic where `value_model=<output_dir>/value_pretrained_critic` finds it in a later run."""
        directory = Path(self.args.output_dir) / PRETRAINED_CRITIC_DIR
        self.accelerator.wait_for_everyone()
        with self._full_weights() as state_dict:
            if self.accelerator.is_main_process:
                tmp = ckpt.temporary_folder(directory)
                shutil.rmtree(tmp, ignore_errors=True)
                self.accelerator.unwrap_model(self.model_wrapped).save_critic(tmp, state_dict)
        if self.accelerator.is_main_process:
            record = {
                "rollouts": self.progress.value_pretrain_rollouts,
                "final_explained_variance": self.progress.final_explained_variance(self.args.value_pretrain_patience),
                "explained_variances": self.progress.explained_variances,
                "policy": get_config_model_id(self.actor_critic.config),
                "policy_fingerprint": self._policy_fingerprint,
            }
            (tmp / VALUE_PRETRAINING_FILE).write_text(json.dumps(record, indent=2))
            ckpt.publish(tmp, directory)
        self.accelerator.wait_for_everyone()

    # -------------------------------------------------------------------------------------------- metrics
    def _all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, "sum") if self.accelerator.num_processes > 1 else tensor

    def _record(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._metrics[key].append(value)

    def _record_step(self, sums: dict[str, torch.Tensor], grad_norms: dict[str, torch.Tensor], phase: str) -> None:
        keys = sorted(sums)
        totals = self._all_reduce_sum(torch.stack([sums[k] for k in keys]))
        totals = dict(zip(keys, totals.tolist()))
        world = self.accelerator.num_processes
        tokens = max(totals.pop("_tokens"), 1.0)
        for key, value in totals.items():
            # Losses were already normalised by the global count: their sum over processes / world is the step's
            # loss. The other entries are token-weighted sums of per-micro-batch means.
            self._metrics[key].append(value / world if key.startswith("loss") else value / tokens)
        for key, value in zip(grad_norms, torch.stack(list(grad_norms.values())).tolist() if grad_norms else []):
            self._metrics[key].append(value)
        self._metrics["skipped_steps"].append(float(self.progress.skipped_steps))
        self._loss_sum += totals["loss"] / world
        self._loss_steps += 1

    def _log_metrics(self, phase: str) -> None:
        # The rates the last step used (as transformers.Trainer logs them), not the next step's.
        rates = self._step_learning_rates
        first = next(iter(rates.values()))
        logs: dict[str, Any] = {
            "learning_rate": rates.get("policy", first),
            "critic_learning_rate": rates.get("critic", first),
        }
        logs["phase"] = phase
        self.log(logs)

    def log(self, logs: dict[str, Any], start_time: float | None = None) -> None:
        """Add the averages of the metrics collected since the last log, then log as `Trainer.log` does."""
        averaged = {key: _nanmean(values) for key, values in self._metrics.items() if values}
        self._metrics.clear()
        super().log({**averaged, **logs}, start_time)

    # --------------------------------------------------------------------------------------- save and load
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy (`AutoModelForCausalLM.from_pretrained(output_dir)`, or a PEFT adapter) with the
        tokenizer, and the critic in `output_dir/critic`."""
        output_dir = Path(output_dir or self.args.output_dir)
        with self._full_weights() as state_dict:
            if self.accelerator.is_main_process:
                self._write_models(output_dir, state_dict)
                self.create_model_card(output_dir=output_dir)
        self.accelerator.wait_for_everyone()

    @contextlib.contextmanager
    def _full_weights(self):
        """Under ZeRO-3 and FSDP2 each rank holds a shard of every weight: gather them for saving (a collective:
        every rank enters, the main process writes). Yields the gathered state dict under FSDP2, else None (the
        parameters themselves are whole)."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if self.is_deepspeed_enabled and plugin is not None and plugin.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.model_wrapped.parameters())):
                yield None
        else:
            yield full_state_dict(self.model_wrapped)

    def _write_models(self, directory: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model_wrapped) if self.model_wrapped is not None else self.model
        model.save_policy(directory, state_dict)
        model.save_critic(directory / CRITIC_SUBFOLDER, state_dict)
        self.processing_class.save_pretrained(directory)
        (directory / "vapo_config.json").write_text(self.args.to_json_string())

    def create_model_card(self, output_dir: Path | None = None, model_name: str | None = None, dataset_name: str | None = None, tags=None, **kwargs) -> None:
        if not self.is_world_process_zero():
            return
        base = get_config_model_id(self.actor_critic.config)
        card = generate_model_card(
            base_model=base if base and not os.path.isdir(base) else None,
            model_name=model_name or Path(self.args.output_dir).name,
            hub_model_id=self.hub_model_id,
            dataset_name=dataset_name,
            tags=sorted(set(self._tag_names) | set(tags or [])),
            wandb_url=None,
            trackio_url=None,
            trainer_name=self._name,
            trainer_citation=self._paper["citation"],
            paper_title=self._paper["title"],
            paper_id=self._paper["id"],
        )
        card.save(str(Path(output_dir or self.args.output_dir) / "README.md"))

    def _save_checkpoint(self, model=None, trial=None) -> None:
        """Write `checkpoint-<step>` completely (policy, critic, optimizer, scheduler, RNG, state), then rename it
        into place: a crash mid-write leaves the previous checkpoint intact."""
        final = Path(self.args.output_dir) / f"{ckpt.CHECKPOINT_PREFIX}-{self.state.global_step}"
        tmp = ckpt.temporary_folder(final)
        main = self.accelerator.is_main_process
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        ckpt.save_rng_state(tmp / f"rng_state_{self.accelerator.process_index}.safetensors")
        with self._full_weights() as state_dict:
            if main:
                self._write_models(tmp, state_dict)
        if self.is_deepspeed_enabled:
            # ZeRO partitions the optimizer state over the ranks: each writes its own part.
            self.model_wrapped.save_checkpoint(str(tmp), tag=DEEPSPEED_CHECKPOINT_TAG, exclude_frozen_parameters=True)
        if main:
            if not self.is_deepspeed_enabled:
                torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(self.lr_scheduler.state_dict(), tmp / "scheduler.pt")
            self.state.stateful_callbacks = {
                type(cb).__name__: cb.state() for cb in self.callback_handler.callbacks + [self.control]
                if isinstance(cb, ExportableState)
            }
            self.state.save_to_json(str(tmp / "trainer_state.json"))
        self.accelerator.wait_for_everyone()
        if main:
            # Written last: its presence marks the folder complete.
            marker = {"progress": dataclasses.asdict(self.progress), "run": self._fingerprint()}
            (tmp / ckpt.COMPLETE_MARKER).write_text(json.dumps(marker, indent=2))
            ckpt.publish(tmp, final)
            ckpt.rotate_checkpoints(self.args.output_dir, self.args.save_total_limit, keep=final)
        self.accelerator.wait_for_everyone()
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _fingerprint(self) -> dict[str, Any]:
        """What a checkpoint must share with the run that resumes it: the model and the batch layout."""
        args = self.args
        config = self.actor_critic.config.to_dict()
        for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"):
            config.pop(key, None)
        return {
            "model": get_config_model_id(self.actor_critic.config),
            "model_config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
            "critic": "adapter on the policy's base" if self.actor_critic.shares_base else "separate model",
            "peft_policy": is_peft_model(self.actor_critic.policy),
            "num_processes": self.accelerator.num_processes,
            "generation_batch_size": args.generation_batch_size,
            "num_generations": args.num_generations,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "num_iterations": args.num_iterations,
            "deepspeed": self.is_deepspeed_enabled,
        }

    def _load_checkpoint(self, path: Path) -> None:
        marker_file = path / ckpt.COMPLETE_MARKER
        if not marker_file.is_file():
            raise ValueError(
                f"{path} is not a complete trl-vapo checkpoint (no {ckpt.COMPLETE_MARKER}); complete ones in its "
                f"folder: {[c.name for c in ckpt.list_checkpoints(path.parent)]}."
            )
        marker = json.loads(marker_file.read_text())
        saved, current = marker["run"], self._fingerprint()
        saved.setdefault("deepspeed", False)  # checkpoints of trl-vapo 0.1 predate the key
        differences = [
            f"{key}: checkpoint {saved.get(key)!r}, this run {current[key]!r}"
            for key in current
            if key != "model" and saved.get(key) != current[key]
        ]
        if differences:
            raise ValueError(
                f"Cannot resume from {path}: it was written by a different run (model {saved.get('model')!r}). "
                + "; ".join(differences)
                + ". Resume with the same model, PEFT setting, process count and batch sizes, or start a new run."
            )
        model = self.actor_critic
        if self.is_deepspeed_enabled:
            loaded, _ = self.model_wrapped.load_checkpoint(
                str(path), tag=DEEPSPEED_CHECKPOINT_TAG, load_module_strict=False, load_lr_scheduler_states=False
            )
            if loaded is None:
                raise ValueError(f"{path} holds no DeepSpeed state ({DEEPSPEED_CHECKPOINT_TAG}/): it was not written by a DeepSpeed run.")
        else:
            model.load_policy(path)
            model.load_critic(path / CRITIC_SUBFOLDER)
            # Loaded on the CPU; `load_state_dict` moves each state to its parameter's device.
            self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        max_steps = self.state.max_steps
        stateful = self.state.stateful_callbacks
        self.state = TrainerState.load_from_json(str(path / "trainer_state.json"))
        self.state.stateful_callbacks = stateful
        self.progress = TrainingProgress.from_dict(marker["progress"])
        if self.progress.phase == RL and self.progress.rl_start_step is not None:
            # Value pretraining may have ended early in the saved run: its unused steps are not in the plan.
            plan = self._plan()
            max_steps = self.progress.rl_start_step + plan["rl_steps"]
        self.state.max_steps = max_steps
        rng_file = path / f"rng_state_{self.accelerator.process_index}.safetensors"
        if rng_file.is_file():
            ckpt.load_rng_state(rng_file)
        else:
            logger.warning(f"{rng_file.name} is missing in {path}: the resumed run will not replay the same samples.")
        logger.info(f"Resumed from {path} at step {self.state.global_step} ({self.progress.phase}).")


# ----------------------------------------------------------------------------------------------------------------------
# Construction helpers
# ----------------------------------------------------------------------------------------------------------------------


def _check_reward_funcs(reward_funcs) -> tuple[list[RewardFunc], list[str]]:
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ValueError("reward_funcs is empty: pass at least one reward function, e.g. trl_vapo.rewards.math_reward.")
    names = []
    for func in funcs:
        if not callable(func) or isinstance(func, nn.Module):
            raise TypeError(
                f"Reward functions must be callables following TRL's protocol, got {type(func).__name__}. "
                "(Reward models are not supported: VAPO learns from verifiers.)"
            )
        if inspect.iscoroutinefunction(func):
            raise TypeError(f"Reward function {getattr(func, '__name__', func)!r} is async; pass a synchronous one.")
        names.append(getattr(func, "__name__", type(func).__name__))
    return list(funcs), names


def _check_train_dataset(dataset, args: VAPOConfig) -> None:
    if dataset is None:
        raise ValueError("train_dataset is required: a datasets.Dataset with a 'prompt' column.")
    if not isinstance(dataset, Dataset):
        raise TypeError(f"train_dataset must be a datasets.Dataset, got {type(dataset).__name__}.")
    if len(dataset) == 0:
        raise ValueError("train_dataset is empty: it needs at least one rollout's worth of prompts.")
    if "prompt" not in dataset.column_names:
        raise ValueError(f"train_dataset has no 'prompt' column; its columns are {dataset.column_names}.")
    prompts_per_rollout = args.generation_batch_size // args.num_generations
    if len(dataset) < prompts_per_rollout:
        raise ValueError(
            f"train_dataset has {len(dataset)} prompts but one rollout needs {prompts_per_rollout} "
            f"(generation_batch_size {args.generation_batch_size} / num_generations {args.num_generations}). Add "
            "prompts, or lower per_device_train_batch_size / steps_per_generation, or raise num_generations."
        )


def _check_quantization(args: VAPOConfig, peft_config) -> None:
    """Fail before loading anything when a quantized model is asked for where it cannot train."""
    quantization = (args.model_init_kwargs or {}).get("quantization_config")
    if quantization is None:
        return
    if peft_config is None:
        raise ValueError(
            "model_init_kwargs asks for a quantized model, and quantized weights cannot be trained: pass a peft_config "
            "(e.g. LoraConfig(r=16), or --use_peft on the command line) to train adapters on it (QLoRA)."
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ImportError(
            "4-bit / 8-bit loading (load_in_4bit, QLoRA) needs bitsandbytes: `pip install bitsandbytes` (it runs on "
            "NVIDIA GPUs and on CPUs), or drop the quantization to train LoRA on a bf16 base."
        ) from None


def _torch_dtype(value):
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return value
    if value in ("float32", "bfloat16", "float16"):
        return getattr(torch, value)
    raise ValueError(f"model_init_kwargs['dtype'] must be 'auto', 'float32', 'bfloat16' or 'float16', got {value!r}.")


def _init_kwargs(args: VAPOConfig) -> dict[str, Any]:
    kwargs = dict(args.model_init_kwargs or {})
    kwargs["dtype"] = _torch_dtype(kwargs.get("dtype", "float32"))
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    kwargs.setdefault("use_safetensors", True)  # never unpickle weights unless the user asks
    return kwargs


def _load_policy(model, args: VAPOConfig) -> tuple[nn.Module, str]:
    if isinstance(model, (str, os.PathLike)):
        model_id = str(model)
        return AutoModelForCausalLM.from_pretrained(model_id, **_init_kwargs(args)), model_id
    if isinstance(model, nn.Module) and hasattr(model, "config"):
        if args.model_init_kwargs:
            logger.warning("model_init_kwargs is ignored: the model is already instantiated.")
        return model, get_config_model_id(model.config)
    raise TypeError(f"model must be a model id, a path or a PreTrainedModel, got {type(model).__name__}.")


def _build_actor_critic(policy: nn.Module, value_model, args: VAPOConfig, fingerprint: str) -> tuple[ActorCritic, bool]:
    """The actor-critic module, and whether its critic comes from a previous value pretraining of this policy."""
    shared = is_peft_model(policy)
    if value_model is None:
        if shared:
            policy.add_adapter(CRITIC_ADAPTER, policy.peft_config[POLICY_ADAPTER])
            policy.set_requires_grad([POLICY_ADAPTER, CRITIC_ADAPTER], True)
            head = ValueHead(policy.config.hidden_size, getattr(policy.config, "initializer_range", 0.02))
            return ActorCritic(policy, value_head=head.to(policy.device)), False
        return ActorCritic(policy, critic=critic_from_policy(policy)), False

    if isinstance(value_model, (str, os.PathLike)):
        path = Path(value_model).expanduser()
        pretrained = _pretrained_for_this_policy(path, fingerprint, args)
        if (path / "adapter_config.json").is_file() and (path / VALUE_HEAD_FILE).is_file():
            if not shared:
                raise ValueError(
                    f"value_model {path} is a critic adapter, which needs the policy's base: pass the same "
                    "peft_config you trained it with."
                )
            policy.load_adapter(str(path), adapter_name=CRITIC_ADAPTER, is_trainable=True)
            policy.set_requires_grad([POLICY_ADAPTER, CRITIC_ADAPTER], True)
            head = ValueHead(policy.config.hidden_size)
            actor_critic = ActorCritic(policy, value_head=head.to(policy.device))
            from safetensors.torch import load_file

            actor_critic.value_head.load_state_dict(load_file(path / VALUE_HEAD_FILE))
            return actor_critic, pretrained
        if path.is_dir() and not (path / "config.json").is_file():
            raise ValueError(
                f"value_model {path} is not a value model: it has neither a transformers config.json nor a trl-vapo "
                f"critic adapter (adapter_config.json + {VALUE_HEAD_FILE}). Files there: "
                f"{sorted(p.name for p in path.iterdir())[:10]}."
            )
        if not path.exists() and _looks_like_a_path(str(value_model)):
            raise FileNotFoundError(f"value_model path {value_model} does not exist.")
        config = AutoConfig.from_pretrained(str(value_model), trust_remote_code=args.trust_remote_code)
        is_classifier = any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
        extra = {} if is_classifier else {"num_labels": 1}
        value_model = AutoModelForSequenceClassification.from_pretrained(str(value_model), **_init_kwargs(args), **extra)
        check_value_model(value_model)
        return ActorCritic(policy, critic=value_model), pretrained

    check_value_model(value_model)
    return ActorCritic(policy, critic=value_model), False


def _pretrained_for_this_policy(path: Path, fingerprint: str, args: VAPOConfig) -> bool:
    """Whether the critic at `path` was value-pretrained against this run's initial policy.

    A critic pretrained against another policy predicts that policy's returns: starting RL from it would skip the
    phase VAPO needs. It is then used as an initialisation and value pretraining runs again.
    """
    record = value_pretraining_record(path)
    if record is None:
        return False
    if "policy_fingerprint" not in record:  # written by trl-vapo 0.1, which did not record it
        logger.warning(f"{path} does not record which policy it was pretrained against; trusting that it is this one.")
        return True
    if record["policy_fingerprint"] == fingerprint:
        return True
    logger.warning(
        f"value_model {path} was value-pretrained against the policy {record.get('policy')!r}, whose weights differ "
        f"from this run's policy: it starts from those weights and value pretraining runs again "
        f"(value_pretrain_steps={args.value_pretrain_steps})."
    )
    return False


def _off_policy_sampling_settings(config: GenerationConfig, model, temperature: float) -> list[str]:
    """Sampling settings, in `config` or inherited from the model's `generation_config`, that change the sampling
    distribution away from softmax(logits / temperature), which is what the losses' log-probabilities assume."""
    defaults = getattr(model, "generation_config", None)

    def value(name):
        mine = getattr(config, name, None)
        return mine if mine is not None else getattr(defaults, name, None)

    checks = {
        "do_sample": lambda v: v is False,
        "num_beams": lambda v: v is not None and v > 1,
        "top_p": lambda v: v is not None and v < 1.0,
        "top_k": lambda v: v is not None and v > 0,
        "min_p": lambda v: v is not None and v > 0,
        "typical_p": lambda v: v is not None and v < 1.0,
        "epsilon_cutoff": lambda v: v is not None and v > 0,
        "eta_cutoff": lambda v: v is not None and v > 0,
        "repetition_penalty": lambda v: v is not None and v != 1.0,
        "encoder_repetition_penalty": lambda v: v is not None and v != 1.0,
        "no_repeat_ngram_size": lambda v: v is not None and v > 0,
        "min_new_tokens": lambda v: v is not None and v > 0,
        "bad_words_ids": lambda v: bool(v),
        "suppress_tokens": lambda v: bool(v),
        "sequence_bias": lambda v: bool(v),
        "temperature": lambda v: v is not None and not math.isclose(v, temperature),
    }
    return [f"{name}={value(name)!r}" for name, changes in checks.items() if changes(value(name))]


def _looks_like_a_path(name: str) -> bool:
    """A hub id is `name` or `org/name`; anything else (`./x`, `/x`, `a/b/c`) was meant as a local path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "The tokenizer has no EOS token, so completions could never end: set `tokenizer.eos_token` (e.g. to the "
            "end-of-turn token of the chat template)."
        )
    if tokenizer.pad_token_id is None:
        logger.warning(f"The tokenizer has no pad token; using its EOS token {tokenizer.eos_token!r} for padding.")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"


def cut_completions(
    completions: torch.Tensor, stop_ids: torch.Tensor, pad_id: int, stop_strings: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each generated row after its first stop token; returns the rows (pad after the end) and their mask.

    With ``stop_strings``, a row without a stop token ends at its last non-pad token: `generate()` fills a row that
    ended on a stop string with pad tokens, which must not train. Without stop strings nothing else ends a row, and a
    trailing pad token is one the model sampled (the pad token is not a stop token).
    """
    width = completions.shape[1]
    positions = torch.arange(width, device=completions.device)
    is_stop = torch.isin(completions, stop_ids)
    has_stop = is_stop.any(dim=1)
    length = torch.where(has_stop, is_stop.int().argmax(dim=1) + 1, width)
    if stop_strings and not bool(torch.isin(torch.tensor([pad_id], device=stop_ids.device), stop_ids)):
        last_real = torch.where(completions != pad_id, positions + 1, 0).amax(dim=1)
        length = torch.where(has_stop, length, last_real)
    mask = positions[None, :] < length[:, None]
    return torch.where(mask, completions, pad_id), mask.long()


def _eos_token_ids(tokenizer, policy) -> list[int]:
    ids = [tokenizer.eos_token_id]
    configured = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids += configured if isinstance(configured, list) else [configured]
    return list(dict.fromkeys(i for i in ids if i is not None))


_TRAINER_KWARGS = {"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra", "kwargs"}


def _required_columns(func) -> list[str]:
    """Keyword parameters of a reward function without a default that the trainer does not supply: dataset columns."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return []
    return [
        p.name for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and p.name not in _TRAINER_KWARGS
    ]


def _preview(sample: dict, limit: int = 200) -> str:
    text = json.dumps(sample, default=str, ensure_ascii=False)
    return text if len(text) <= limit * 3 else text[: limit * 3] + "..."


def _mean(values: torch.Tensor) -> float:
    return values.float().mean().item() if values.numel() else math.nan


def _std(values: torch.Tensor) -> float:
    return values.float().std().item() if values.numel() > 1 else math.nan


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _global_masked_mean(values: torch.Tensor, mask: torch.Tensor, all_reduce) -> float:
    sums = torch.stack([(values * mask).sum(), mask.sum()])
    if all_reduce is not None:
        sums = all_reduce(sums)
    return (sums[0] / sums[1].clamp(min=1)).item()
