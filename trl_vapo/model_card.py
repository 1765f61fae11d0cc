"""The model card (`README.md`) written next to a trained policy.

TRL's `generate_model_card` assumes a hub model: for a local base it writes "a fine-tuned version of
[None](https://huggingface.co/None)" and `pipeline(model="None")`, and its front matter has `licence: license`. This
card names a local base by its path (and links only hub ids), points the quick start at something that loads (the
hub id the run pushes to, or the saved folder), and says how the model was trained: the seven VAPO settings, value
pretraining, the critic and where it is, the held-out accuracy before and after when the run measured it, and a
summary of the training metrics.

`build_model_card` takes plain values, so the trainer and the CLI call it with what they know.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from .metric_names import ACCURACY, EXPLAINED_VARIANCE, REWARD, RL, VALUE_PRETRAIN, value_pretraining_end

VAPO_PAPER_TITLE = "VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning Tasks"
VAPO_PAPER_ID = "2504.05118"
VAPO_CITATION = (
    "@article{yue2025vapo,\n"
    "    title   = {{VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning Tasks}},\n"
    "    author  = {Yu Yue and Yufeng Yuan and Qiying Yu and Xiaochen Zuo and Ruofei Zhu and Wenyuan Xu and "
    "Jiaze Chen and Chengyi Wang and TianTian Fan and Zhengyin Du and Xiangpeng Wei and Xiangyu Yu and Gaohong Liu "
    "and Juncai Liu and Lingjun Liu and Haibin Lin and Zhiqi Lin and Bole Ma and Chi Zhang and Mofan Zhang "
    "and Wang Zhang and Hang Zhu and Ru Zhang and Xin Liu and Mingxuan Wang and Yonghui Wu and Lin Yan},\n"
    "    year    = 2025,\n"
    "    eprint  = {arXiv:2504.05118},\n"
    "}"
)
TRL_CITATION = (
    "@software{vonwerra2020trl,\n"
    "  title   = {{TRL: Transformers Reinforcement Learning}},\n"
    "  author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, Tristan "
    "and Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallouédec, Quentin},\n"
    "  license = {Apache-2.0},\n"
    "  url     = {https://github.com/huggingface/trl},\n"
    "  year    = {2020}\n"
    "}"
)

TRACKIO_BADGE = "https://raw.githubusercontent.com/gradio-app/trackio/refs/heads/main/trackio/assets/badge.png"
DEFAULT_TAGS = ["generated_from_trainer", "trl", "trl-vapo", "vapo"]
_DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow", ".txt")
# Training metrics the card summarises, when the run logged them, with how to print them.
_SUMMARY_METRICS = [
    (REWARD, "reward", "{:+.3f}"),
    (ACCURACY, "accuracy", "{:.3f}"),
    (EXPLAINED_VARIANCE, "critic explained variance", "{:.3f}"),
    ("completions/mean_length", "mean completion length (tokens)", "{:.1f}"),
    ("entropy", "policy entropy", "{:.3f}"),
]


def is_hub_id(name: str | os.PathLike | None) -> bool:
    """Whether `name` reads as a Hugging Face Hub repo id (`gpt2`, `org/name`) rather than a local path.

    An existing local path, a data file name, or anything `validate_repo_id` rejects (`/x`, `./x`, `a/b/c`) is local.
    """
    if not name:
        return False
    name = str(name)
    if os.path.exists(name) or name.lower().endswith(_DATA_SUFFIXES) or name.startswith((".", "~")):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


@dataclasses.dataclass
class RunRecord:
    """What the saving code and the model card know of a run, filled by the trainer as it learns it (they read no
    attribute of the trainer's own).

    Args:
        base_model: the policy's starting point (`config._name_or_path`).
        policy_fingerprint: the loaded policy's digest (`modeling.policy_fingerprints`): a saved critic records
            which policy it was pretrained against.
        value_targets: what the critic's targets depend on besides the policy (`modeling.value_target_settings`):
            a saved pretrained critic records them.
        base_fingerprint: the base model's weights alone (`modeling.policy_fingerprints`): a checkpoint records them,
            and a resume onto other weights is refused.
        example_prompt: the first training prompt, for the card's quick start.
        is_adapter: the policy is a PEFT adapter.
        adapter_type: its kind, as the card names it (`adapter_type_name`: "LoRA", "IA3", ...).
        critic_shares_base: the critic is a second adapter on the policy's base.
        value_function: the name of a frozen value function that gives the values, else None.
        critic_pretrained: the critic came from an earlier value pretraining (`value_model=`).
        critic_auto_class: a separate critic's architecture has an `AutoModelForSequenceClassification` class (else
            the critic loads back as `value_model=` alone).
        critic_source: where a critic passed as `value_model` started (its path or model id); None: from the policy.
    """

    base_model: str | None = None
    policy_fingerprint: str | None = None
    base_fingerprint: str | None = None
    value_targets: dict[str, Any] | None = None
    example_prompt: Any = None
    is_adapter: bool = False
    adapter_type: str = "LoRA"
    critic_shares_base: bool = False
    value_function: str | None = None
    critic_pretrained: bool = False
    critic_auto_class: bool = True
    critic_source: str | None = None


def build_model_card(
    *,
    base_model: str | None,
    output_dir: str | os.PathLike,
    args: Any = None,
    model_name: str | None = None,
    hub_model_id: str | None = None,
    dataset_name: str | None = None,
    dataset_config: str | None = None,
    dataset_description: str | None = None,
    is_adapter: bool = False,
    adapter_type: str = "LoRA",
    critic_shares_base: bool = False,
    critic_auto_class: bool = True,
    critic_source: str | None = None,
    value_function: str | None = None,
    value_pretraining: dict[str, Any] | None = None,
    pretrained_critic_dir: str | os.PathLike | None = None,
    held_out: dict[str, Any] | None = None,
    log_history: Sequence[dict[str, Any]] | None = None,
    example_prompt: Any = None,
    tags: Sequence[str] = (),
    license: str | None = None,
    wandb_url: str | None = None,
    trackio_url: str | None = None,
    citation: str | None = VAPO_CITATION,
    hub_revision: str | None = None,
) -> ModelCard:
    """The model card of a VAPO run, with valid front matter (`card.data`) and a body a user can publish as is.

    Args:
        base_model: the policy's starting point, a hub id or a local path (`config._name_or_path`). Only a hub id goes
            in the front matter and gets a link; a local path is written as such.
        output_dir: the folder the card is written to, with the policy (and `critic/`) in it.
        args: the run's `VAPOConfig` (any object with its field names); its VAPO settings fill the tables.
        model_name: the card's title. Default: the last part of `hub_model_id`, else the folder's name.
        hub_model_id: the repo the model is pushed to, if any: the quick start loads it (else `output_dir`).
        dataset_name, dataset_config: the training data: a hub id (linked, and listed in the front matter) or a local
            file or folder. `dataset_description` replaces the sentence when the data has no name (the demo's task).
        is_adapter: the folder holds a PEFT adapter (`library_name: peft`) rather than full weights.
        adapter_type: the adapter's kind, as the card names it ("LoRA", "IA3", ...: `adapter_type_name`).
        critic_shares_base: the critic is a second adapter on the policy's base (`ActorCritic.shares_base`), not a
            separate model.
        critic_auto_class: a separate critic's architecture has an `AutoModelForSequenceClassification` class.
        critic_source: where a critic passed as `value_model` started (a path or model id); None: the policy's weights.
        value_function: the name of the frozen value function (`value_model=` a `ValueFunction`) that replaced the
            critic, if one did: no critic was trained or saved.
        value_pretraining: what value pretraining did, e.g. the record saved with the pretrained critic
            (`modeling.value_pretraining_record`): `rollouts` (run), `final_explained_variance` (default: the last
            one logged in that phase), the number of readings it is the median of, `final_readings` (default 1), and
            `final_statistic` ("median"; a record without it, of an earlier version: "mean"), optionally
            `best_explained_variance`; or `skipped` (a reason) when it did not run.
        pretrained_critic_dir: where the critic saved at the end of value pretraining is (`value_pretrained_critic`).
        held_out: `{"before": {...}, "after": {...}}` with `EvaluationResult.as_dict()` scores, and optionally
            `description` (which problems, how sampled).
        log_history: `trainer.state.log_history`, for the training-metrics summary.
        example_prompt: a training prompt (text or chat messages) for the quick start, so it uses the trained format.
        tags: extra tags. license: an SPDX-style id (e.g. the base model's), omitted when unknown.
        wandb_url, trackio_url: run dashboards, shown as badges.
        citation: the method's BibTeX (VAPO's by default); TRL's is always added.
        hub_revision: the Hub branch the card goes to (`push_to_hub(revision=...)`; default `args.hub_revision`),
            which its quick start loads.
    """
    output_dir = Path(output_dir)
    if value_pretraining is not None and value_pretraining.get("final_explained_variance") is None:
        value_pretraining = {
            **value_pretraining,
            "final_explained_variance": _last_logged(log_history, EXPLAINED_VARIANCE, phase=VALUE_PRETRAIN),
        }
    base_on_hub = is_hub_id(base_model)
    dataset_on_hub = is_hub_id(dataset_name)
    model_name = model_name or (hub_model_id.split("/")[-1] if hub_model_id else output_dir.resolve().name)
    adapter_tags = [adapter_type.lower(), "peft"] if adapter_type == "LoRA" else ["peft"]
    tag_list = list(dict.fromkeys([*DEFAULT_TAGS, *tags, *(adapter_tags if is_adapter else [])]))
    if is_adapter and base_on_hub:
        tag_list.append(f"base_model:adapter:{base_model}")
    card_data = ModelCardData(
        base_model=base_model if base_on_hub else None,
        datasets=[dataset_name] if dataset_on_hub else None,
        library_name="peft" if is_adapter else "transformers",
        license=license,
        model_name=model_name,
        pipeline_tag="text-generation",
        tags=tag_list,
    )
    branch = hub_revision or getattr(args, "hub_revision", None)  # the Hub branch the card goes to
    sections = [
        f"# Model Card for {model_name}",
        _intro(
            base_model,
            base_on_hub,
            dataset_name,
            dataset_config,
            dataset_on_hub,
            dataset_description,
            adapter_type if is_adapter else None,
        ),
        _quick_start(
            hub_model_id or str(output_dir.resolve()),
            hub_model_id is None,
            example_prompt,
            args,
            is_adapter,
            base_model,
            branch,
        ),
        _held_out_section(held_out),
        _training_section(args, value_pretraining, log_history, wandb_url, trackio_url, value_function),
        _critic_section(
            critic_shares_base,
            critic_auto_class,
            output_dir,
            pretrained_critic_dir,
            value_pretraining,
            value_function,
            critic_source,
            adapter_type,
            hub_model_id if branch in (None, "main") else None,  # (`value_model` reads a Hub critic from `main`)
        ),
        _versions_section(is_adapter),
        _citations_section(citation),
    ]
    body = "\n\n".join(s for s in sections if s)
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n{body}\n")


# ---------------------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------------------


def adapter_type_name(peft_config) -> str:
    """How the card names a PEFT config's kind: LoRA (DoRA too: a LoraConfig's), else peft's own name of it (IA3,
    LOHA, ADALORA, PROMPT_TUNING, ...)."""
    peft_type = getattr(peft_config, "peft_type", None)
    kind = str(getattr(peft_type, "value", peft_type) or "LORA")
    return "LoRA" if kind == "LORA" else kind


def _adapter_phrase(adapter_type: str) -> str:
    return "LoRA adapter" if adapter_type == "LoRA" else f"PEFT adapter ({adapter_type})"


def _intro(
    base_model, base_on_hub, dataset_name, dataset_config, dataset_on_hub, dataset_description, adapter: str | None
) -> str:
    if base_on_hub:
        base = f"[{base_model}](https://huggingface.co/{base_model})"
    elif base_model:
        base = f"the local model `{base_model}`"
    else:
        base = "a model whose origin the run did not record"
    text = (
        f"This is a {_adapter_phrase(adapter)} for {base}"
        if adapter
        else f"This model is a fine-tuned version of {base}"
    )
    config = f" (`{dataset_config}`)" if dataset_config else ""
    if dataset_on_hub:
        text += f", trained on the [{dataset_name}](https://huggingface.co/datasets/{dataset_name}){config} dataset"
    elif dataset_name:
        text += f", trained on the local data set `{dataset_name}`{config}"
    elif dataset_description:
        text += f", trained on {dataset_description}"
    return (
        f"{text}.\nIt was trained with VAPO ([{VAPO_PAPER_TITLE}](https://huggingface.co/papers/{VAPO_PAPER_ID})), "
        "PPO with a value model, using trl-vapo's `VAPOTrainer` on [TRL](https://github.com/huggingface/trl)."
    )


def _quick_start(
    model_ref: str, is_local: bool, example_prompt, args, is_adapter: bool, base_model, revision: str | None
) -> str:
    if example_prompt is None:
        example_prompt = [{"role": "user", "content": "What is 17 + 25? Put the final answer in \\boxed{}."}]
    max_new_tokens = getattr(args, "max_completion_length", None) or 256
    where = "  # this folder; once uploaded, its Hub id" if is_local else ""
    # The branch the card is pushed to (`revision`): without it, `main`, which may hold another model or none.
    options = f', revision="{revision}"' if revision and not is_local else ""
    # A chat prompt rendered as training rendered it (`chat_template_kwargs`: Qwen3's enable_thinking=False, say);
    # the pipeline hands `tokenizer_encode_kwargs` to `apply_chat_template`.
    template = getattr(args, "chat_template_kwargs", None) if isinstance(example_prompt, list) else None
    encode = f", tokenizer_encode_kwargs={dict(template)!r}" if template else ""
    # A model of custom code (`trust_remote_code`, as it trained): without it, `pipeline` refuses to load it.
    options += ", trust_remote_code=True" if getattr(args, "trust_remote_code", False) else ""
    lines = [
        "## Quick start",
        "",
        "```python",
        "from transformers import pipeline",
        "",
        f"prompt = {example_prompt!r}",
        f'generator = pipeline("text-generation", model="{model_ref}"{options}, device_map="auto"){where}',
        f"output = generator(prompt, max_new_tokens={max_new_tokens}, return_full_text=False{encode})[0]",
        'print(output["generated_text"])',
        "```",
    ]
    if is_adapter:
        source = f"`{base_model}`" if base_model else "the base model named in `adapter_config.json`"
        lines += [
            "",
            (
                f"The folder holds a PEFT adapter: `pipeline` (with `peft` installed) loads its base model, {source}, "
                "and applies it. `peft.AutoPeftModelForCausalLM.from_pretrained` loads it too."
            ),
        ]
    return "\n".join(lines)


def _held_out_section(held_out: dict[str, Any] | None) -> str:
    if not held_out or not held_out.get("before") or not held_out.get("after"):
        return ""
    before, after = held_out["before"], held_out["after"]
    rows = ["| metric | before training | after training |", "| --- | --- | --- |"]
    names = {"pass@1": "pass@1 (greedy)"}
    for key in before:
        if key in ("num_problems", "num_unscored", "num_partly_scored") or key not in after:
            continue
        label = names.get(key, "mean completion length (tokens)" if key == "mean_length" else key)
        if key.startswith("avg@"):
            label = f"{key} (sampled)"
        fmt = "{:.1f}" if key == "mean_length" else "{:.3f}"
        rows.append(f"| {label} | {format_finite(fmt, before[key])} | {format_finite(fmt, after[key])} |")
    count = before.get("num_problems")
    description = held_out.get("description") or (f"{count} held-out problems" if count else "held-out problems")
    partly = [report.get("num_partly_scored", 0) for report in (before, after)]
    left_out = (
        f"; {partly[0]} partly scored problems left out before training, {partly[1]} after" if any(partly) else ""
    )
    # Problems none of whose samples a reward scored are out of avg@k and pass@k, and each report has its own (a
    # judge's timeouts, a reward returning None): the two columns may be of different sets. pass@1 counts the greedy
    # answers scored, the mean length every sample.
    unscored = [report.get("num_unscored", 0) for report in (before, after)]
    if any(unscored):
        left_out += (
            f"; {unscored[0]} problems none of whose samples a reward scored left out of avg@k and pass@k before "
            f"training, {unscored[1]} after"
        )
    return (
        "## Evaluation\n\n"
        f"Scored before and after training by the training reward functions on {description}: pass@1 decodes "
        "greedily; avg@k is the mean fraction of k samples judged correct, pass@k the fraction of problems with at "
        f"least one (of those whose k samples were all scored{left_out}).\n\n" + "\n".join(rows)
    )


def _training_section(args, value_pretraining, log_history, wandb_url, trackio_url, value_function=None) -> str:
    parts = ["## Training procedure"]
    badges = []
    if wandb_url:
        badges.append(
            '[<img src="https://raw.githubusercontent.com/wandb/assets/main/wandb-github-badge-28.svg" '
            f'alt="Visualize in Weights & Biases" width="150" height="24"/>]({wandb_url})'
        )
    if trackio_url:
        badges.append(
            f'[<img src="{TRACKIO_BADGE}" alt="Visualize in Trackio" title="Visualize in Trackio" width="150" '
            f'height="24"/>]({trackio_url})'
        )
    if badges:
        parts.append(" ".join(badges))
    intro = (
        "VAPO is PPO with a value model plus seven techniques that keep the value model trustworthy on long chains "
        "of thought scored by a verifier."
    )
    parts.append(intro + (" This run's settings, next to the paper's:" if args is not None else ""))
    if args is not None:
        parts.append(_vapo_table(args, value_pretraining, value_function))
        other = _other_settings(args, frozen_values=value_function is not None)
        if other:
            parts.append("Other settings: " + ", ".join(other) + ".")
    summary = _metrics_summary(log_history)
    if summary:
        parts.append(summary)
    return "\n\n".join(parts)


def _vapo_table(args, value_pretraining, value_function: str | None = None) -> str:
    """The seven techniques as this run set them (`value_function`: the frozen value function that gave the values,
    whose run pretrained and trained no critic)."""

    def get(name):
        return getattr(args, name, None)

    steps, patience = get("value_pretrain_steps"), get("value_pretrain_patience")
    done = _value_pretraining_outcome(value_pretraining)
    if value_function is not None:
        pretrain = f"none: the values are the frozen value function's (`{value_function}`)"
    elif steps == 0 and done and not value_pretraining.get("skipped"):  # it ran, then a resume set 0 (which ended it)
        pretrain = f"`value_pretrain_steps=0` on resuming: {done}"
    elif steps == 0:
        pretrain = "off (`value_pretrain_steps=0`)"
    else:
        pretrain = f"`value_pretrain_steps={steps}`"
        if patience is not None and steps >= 2 * patience:  # the rule compares two windows of readings
            pretrain += f" (stops early when explained variance stops improving, window {patience})"
        if done:
            pretrain += f": {done}"
    alpha = get("length_adaptive_alpha")
    alpha_text = f"`length_adaptive_alpha={alpha}`" if alpha is not None else "off (`length_adaptive_alpha=None`)"
    # With length-adaptive GAE the policy's lambda is 1 - 1/(alpha l) per completion: `lam_actor` is not used.
    actor_lambda = f"`lam_actor={get('lam_actor')}`" if alpha is None else "the policy's: length-adaptive (3)"
    # The critic's lambda sets its targets: with frozen values nothing learns from them.
    critic_lambda = f"`lam_critic={get('lam_critic')}`" if value_function is None else "no critic targets"
    loss_text = f'`loss_type="{get("loss_type")}"`'
    clip_text = f"`epsilon={get('epsilon')}`, `epsilon_high={get('epsilon_high')}`"
    surrogate = get("surrogate") or "ppo"
    if surrogate != "ppo":  # GRPO's other losses: not PPO's clipped ratio, so no clip-higher
        loss_text += f', `surrogate="{surrogate}"` (GRPO\'s {surrogate.upper()} loss)'
        clip_text = f'none: `surrogate="{surrogate}"`' + (
            f" caps the importance weight at `epsilon_high={get('epsilon_high')}`" if surrogate == "cispo" else ""
        )
    rows = [
        ("1", "value pretraining", pretrain, "50 rollouts"),
        ("2", "decoupled GAE", f"{critic_lambda}, {actor_lambda}", "1.0, 0.95"),
        ("3", "length-adaptive GAE", alpha_text, "alpha = 0.05"),
        ("4", "token-level policy loss", loss_text, "token"),
        ("5", "clip-higher", clip_text, "0.2, 0.28"),
        ("6", "positive-example LM loss", f"`nll_coef={get('nll_coef')}`", "mu = 0.1"),
        ("7", "group sampling", f"`num_generations={get('num_generations')}`", "16"),
    ]
    lines = ["| # | technique | this run | paper |", "| --- | --- | --- | --- |"]
    lines += [f"| {n} | {name} | {setting} | {paper} |" for n, name, setting, paper in rows]
    return "\n".join(lines)


OTHER_SETTINGS = [
    "learning_rate",
    "critic_learning_rate",
    "lr_scheduler_type",
    "beta",
    "gamma",
    "temperature",
    "max_completion_length",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "generation_batch_size",
    "num_iterations",
    "max_steps",
    "seed",
]
"""The settings every card names."""
OTHER_SETTINGS_WHEN_CHANGED = [
    "num_train_epochs",
    "critic_num_iterations",
    "value_pretrain_num_iterations",
    "value_pretrain_replay",
    "warmup_steps",
    "warmup_ratio",
    "vf_coef",
    "cliprange_value",
    "whiten_advantages",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_prompt_length",
    "reward_weights",
    "positive_reward_funcs",
    "multi_objective_aggregation",
    "mask_truncated_completions",
    "importance_sampling_level",
    "delta",
    "top_entropy_quantile",
    "entropy_coef",
    "use_adaptive_entropy",
    "off_policy_mask_threshold",
    "sync_ref_model",
    "chat_template_kwargs",
]
"""The settings a card names where the run changed them from their defaults (a reader needs them to train alike)."""


CRITIC_SETTINGS = {
    "critic_learning_rate",
    "critic_num_iterations",
    "value_pretrain_num_iterations",
    "value_pretrain_replay",
    "vf_coef",
    "cliprange_value",
}
"""Settings of a critic that learns: a card of a run with frozen values leaves them out."""


PASSES_DEFAULTING_TO_NUM_ITERATIONS = {"critic_num_iterations", "value_pretrain_num_iterations"}


def _other_settings(args, frozen_values: bool = False) -> list[str]:
    defaults = {f.name: f.default for f in dataclasses.fields(args)} if dataclasses.is_dataclass(args) else {}
    names = OTHER_SETTINGS + [n for n in OTHER_SETTINGS_WHEN_CHANGED if n in defaults]
    settings = []
    for name in names:
        value = getattr(args, name, None)
        if frozen_values and name in CRITIC_SETTINGS:
            continue
        if name == "num_train_epochs":  # named where it decides the run's length: max_steps unset
            if getattr(args, "max_steps", -1) <= 0:
                settings.append(f"`num_train_epochs={value}`")
            continue
        if name == "max_steps" and value is not None and value <= 0:  # unset (-1): the epochs decide
            continue
        # (the critic's passes default to num_iterations, resolved after the dataclass's None: unset, the same)
        default = getattr(args, "num_iterations", None) if name in PASSES_DEFAULTING_TO_NUM_ITERATIONS else None
        if value is None or (name in OTHER_SETTINGS_WHEN_CHANGED and value in (defaults[name], default)):
            continue
        value = getattr(value, "value", value)  # enums such as lr_scheduler_type
        settings.append(f"`{name}={value!r}`" if isinstance(value, str) else f"`{name}={value}`")
    return settings


def _value_pretraining_outcome(value_pretraining) -> str:
    """One clause on what value pretraining did, from the trainer's record (or '' when there is none)."""
    if not value_pretraining:
        return ""
    if value_pretraining.get("skipped"):
        return f"skipped: {value_pretraining['skipped']}"
    rollouts = value_pretraining.get("rollouts")
    final = value_pretraining.get("final_explained_variance")
    text = f"ran {rollouts} rollout{'s' if rollouts != 1 else ''}" if rollouts is not None else "ran"
    best = value_pretraining.get("best_explained_variance")
    best_text = f"best {best:.3f}" if _finite(best) and (not _finite(final) or abs(best - final) > 5e-4) else ""
    if _finite(final):  # the median of the last readings (the stop rule's window): one reading is noisy
        readings = value_pretraining.get("final_readings", 1)  # (without a record: the last one logged)
        # Each reading is of a rollout's values before the critic trained on it: the last update is not in it.
        if readings > 1:
            statistic = value_pretraining.get("final_statistic", "mean")
            said = f"{statistic} of its last {readings} readings, each taken before the critic's update on its rollout"
        else:
            said = "its last reading, taken before the critic's update on its rollout"
        text += f", final explained variance {final:.3f} ({said}"
        text += f"; {best_text})" if best_text else ")"
    elif best_text:
        text += f" ({best_text})"
    return text


def start_and_end_window(num_logs: int) -> int:
    """How many logs the start's and the end's means of a run's metrics take, here and in `trl-vapo train`'s
    summary: up to 3, so that the two never overlap (with one log, both are it)."""
    return max(1, min(3, num_logs // 2))


def start_and_end_means(log_history, keys) -> tuple[int, dict[str, tuple[float, float]]]:
    """Each metric of `keys` at a run's start and end: the mean of the first and of the last n RL logs
    (`start_and_end_window`), NaN and missing values left out (NaN where none is left), and n (0, {}: no RL log). The
    model card's training table and `trl-vapo train`'s summary."""
    logs = [h for h in (log_history or []) if h.get("phase") == RL and REWARD in h]
    if not logs:
        return 0, {}
    n = start_and_end_window(len(logs))
    return n, {key: (_mean([h.get(key) for h in logs[:n]]), _mean([h.get(key) for h in logs[-n:]])) for key in keys}


def _metrics_summary(log_history) -> str:
    """Mean of the first and last few RL logs of the summary metrics, as the CLI's end-of-run summary takes them."""
    n, means = start_and_end_means(log_history, [key for key, _, _ in _SUMMARY_METRICS])
    if not n:
        return ""
    rows = ["| metric | start | end |", "| --- | --- | --- |"]
    for key, label, fmt in _SUMMARY_METRICS:
        first, last = means[key]
        if _finite(first) or _finite(last):
            rows.append(f"| {label} | {format_finite(fmt, first)} | {format_finite(fmt, last)} |")
    steps = max((h.get("step", 0) for h in log_history), default=0)
    # The steps count value pretraining's (the critic alone), which `max_steps` among the settings does not.
    pretrain = value_pretraining_end(log_history) or 0
    split = f" ({pretrain} of value pretraining, {steps - pretrain} of RL)" if pretrain else ""
    return (
        f"### Training metrics\n\n{steps} optimizer steps{split}. Start and end: the mean of the first and of the "
        f"last {n} RL logging step{'s' if n > 1 else ''}.\n\n" + "\n".join(rows)
    )


def _critic_section(
    shares_base: bool,
    auto_class: bool,
    output_dir: Path,
    pretrained_critic_dir,
    value_pretraining,
    value_function: str | None = None,
    source: str | None = None,
    adapter_type: str = "LoRA",
    hub_model_id: str | None = None,
) -> str:
    if value_function is not None:
        return (
            "### Value model (critic)\n\nNo critic was trained: GAE read the values of a frozen value function "
            f"(`{value_function}`, passed as `value_model`), which is not saved here."
        )
    started = "the policy's weights" if source is None else f"`{source}` (`value_model`)"
    if shares_base:
        kind = (
            f"The critic is a second {_adapter_phrase(adapter_type)} on the policy's frozen base model, with a linear "
            "value head. "
            "`critic/` in this folder holds the adapter (`adapter_config.json`, `adapter_model.safetensors`) and "
            "the head (`value_head.safetensors`)."
        )
        if source is not None:
            kind += f" It started from the critic `{source}` (`value_model`)."
    elif auto_class:
        kind = (
            f"The critic is a separate model that started from {started}: `critic/` in this folder is a "
            "one-label `AutoModelForSequenceClassification` (`from_pretrained` loads it)."
        )
    else:
        kind = (
            f"The critic is a separate model that started from {started}: `critic/` in this folder is the "
            "policy's backbone with a one-label linear head, laid out as a sequence classifier; transformers has no "
            "`AutoModelForSequenceClassification` class for this architecture, so trl-vapo loads it "
            '(`VAPOTrainer(..., value_model="critic")`).'
        )
    lines = ["### Value model (critic)", "", kind, ""]
    outcome = _value_pretraining_outcome(value_pretraining)
    if outcome:
        lines.append(f"- Value pretraining: {outcome}.")
    if pretrained_critic_dir is not None:
        shown = _display_path(pretrained_critic_dir, output_dir)
        if hub_model_id and not shown.endswith("`output_dir`"):  # pushed with the model (`push_to_hub`)
            shown += f' (from the Hub: `value_model="{hub_model_id}/{Path(pretrained_critic_dir).name}"`)'
        lines.append(
            f"- The critic as value pretraining left it: {shown}. Pass "
            "that folder as `value_model=` (with the same `peft_config` for an adapter critic) to skip value "
            "pretraining in a new run from the same starting policy (the base model above, not this trained one) "
            "under the same rewards and sampling settings."
        )
    lines.append("- Only further training needs the critic: generation uses the policy alone.")
    return "\n".join(lines)


def _versions_section(is_adapter: bool) -> str:
    packages = [
        ("trl-vapo", "trl-vapo"),
        ("TRL", "trl"),
        ("Transformers", "transformers"),
        ("PyTorch", "torch"),
        ("Datasets", "datasets"),
        ("Tokenizers", "tokenizers"),
    ]
    if is_adapter:
        packages.append(("PEFT", "peft"))
    lines = ["### Framework versions", ""]
    for label, package in packages:
        try:
            lines.append(f"- {label}: {version(package)}")
        except PackageNotFoundError:
            continue
    return "\n".join(lines)


def _citations_section(citation: str | None) -> str:
    parts = ["## Citations"]
    if citation:
        parts.append(f"Cite VAPO as:\n\n```bibtex\n{citation}\n```")
    parts.append(f"Cite TRL as:\n\n```bibtex\n{TRL_CITATION}\n```")
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------------------------------


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _last_logged(log_history, key: str, phase: str) -> float | None:
    values = [h[key] for h in (log_history or []) if h.get("phase") == phase and _finite(h.get(key))]
    return values[-1] if values else None


def _mean(values) -> float:
    finite = [v for v in values if _finite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def format_finite(fmt: str, value) -> str:
    """`value` in `fmt`, or "n/a" for a NaN, an infinity or None (a metric no log held)."""
    return fmt.format(value) if _finite(value) else "n/a"


def _display_path(path, folder: Path) -> str:
    """`path` relative to the card's folder when it lies inside it (`value_pretrained_critic/`). A checkpoint's card
    (the one pushed while training) is not beside it: the folder is named in the run's `output_dir`, not by its
    absolute path, which would say nothing on the Hub (a checkpoint's push does not upload the folder; the final push
    does) but the trainer's home and user."""
    path = Path(path).resolve()
    try:
        return f"`{path.relative_to(folder.resolve()).as_posix()}/`"
    except ValueError:
        return f"`{path.name}/` in the training run's `output_dir`"
