"""The tests' shared helpers: reward functions, data, a VAPOConfig for a tiny run, and readers of what a run logged.
(Runs in processes of their own: `_script_process.py`; the scripts those run: `_train_script.py`,
`_reward_torchrun_script.py`.)"""

from __future__ import annotations

import copy
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, GenerationConfig
from trl.generation.vllm_generation import VLLMGeneration

from trl_vapo import VAPOConfig, VAPOTrainer
from trl_vapo.generation import GenerationOutput, SamplingSettings
from trl_vapo.modeling import CRITIC_ADAPTER, POLICY_ADAPTER, ActorCritic, ValueHead, completion_logprobs

ROOT = Path(__file__).resolve().parent.parent


def digit_fraction(completions, **kwargs):
    """Dense, learnable reward in [-1, 1]: twice the fraction of digit characters, minus one."""
    return [2 * sum(ch.isdigit() for ch in c) / max(len(c), 1) - 1 for c in completions]


def first_char_is_letter(completions, **kwargs):
    """+1 when the completion starts with a letter: predictable by the critic once that token is in the state."""
    return [1.0 if c[:1].isalpha() else -1.0 for c in completions]


def prompts_dataset(n=64, **extra):
    """`n` sums as prompts with their answers (and `extra` columns, the same in every row)."""
    return Dataset.from_list([{"prompt": f"{i}+{i}=", "answer": str(2 * i), **extra} for i in range(n)])


def make_args(tmp_path, **overrides) -> VAPOConfig:
    settings = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        value_pretrain_steps=0,
        learning_rate=1e-3,
        critic_learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        # The diagnostic PNGs cost about a second per run (matplotlib); test_diagnostics and the demo's test draw them.
        plot_diagnostics=False,
        seed=0,
    )
    settings.update(overrides)
    return VAPOConfig(**settings)


EARLY_STOPPING = dict(
    max_steps=8,
    eval_strategy="steps",
    eval_steps=1,
    metric_for_best_model="loss",
    save_strategy="best",
    load_best_model_at_end=True,
    learning_rate=3e-2,
    critic_learning_rate=3e-2,
)
"""A run that EarlyStoppingCallback(early_stopping_patience=1) stops after its best checkpoint (an evaluation at each
step, at a rate that moves eval_loss both ways), ending with the best checkpoint's weights."""


class CapturingTrainer(VAPOTrainer):
    """Keeps every rollout it trains on, so tests can recompute what the losses should have been."""

    def _make_rollout(self, rows, phase, *args, **kwargs):
        rollout = super()._make_rollout(rows, phase, *args, **kwargs)
        self.rollouts = getattr(self, "rollouts", []) + [(rows, rollout)]
        return rollout


def rl_logs(trainer):
    return [h for h in trainer.state.log_history if h.get("phase") == "rl"]


def token_rewards_of(trainer, rows, rollout):
    """Recompute the per-token rewards from the rollout's completions with the reward function itself."""
    completions = rollout.input_ids[:, rollout.prompt_length :]
    mask = rollout.attention_mask[:, rollout.prompt_length :]
    texts = trainer.processing_class.batch_decode(
        [c[m.bool()].tolist() for c, m in zip(completions, mask)], skip_special_tokens=True
    )
    scores = torch.tensor(trainer.reward_funcs[0](completions=texts))
    lengths = mask.sum(dim=1)
    rewards = torch.zeros(mask.shape)
    rewards[torch.arange(len(texts)), lengths - 1] = scores
    return rewards, lengths, scores


def clock_free(entry: dict) -> dict:
    """A log entry less what the clock says (the run's time, each step's seconds), which no two runs share."""
    return {k: v for k, v in entry.items() if not k.startswith("train_") and k != "step_time"}


def comparable(history):
    return [clock_free(h) for h in history if "phase" in h]


def run_benchmark(script: str, *args: str) -> str:
    """`benchmarks/<script> ARGS` in a fresh process (one torch thread); its stdout, or the failure's output."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


# ---------------------------------------------------------------------------------------------------------------------
# Generation: prompts, an actor-critic with both adapters, the trainer's log-probs, and a stand-in for vLLM
# ---------------------------------------------------------------------------------------------------------------------

GREEDY = SamplingSettings(max_new_tokens=24, temperature=0.0)
TEXT_PROMPTS = ["1+2=", "hello world, how are", "a", "The quick brown fox jumps over", "x=7; y=", "??"]


def token_ids(tokenizer, texts):
    return tokenizer(text=texts)["input_ids"]


def peft_actor_critic(model_dir, modules_to_save=None, seed=0, dtype=torch.float32) -> ActorCritic:
    """The trainer's shared-base layout: policy adapter "default", critic adapter "critic", a value head; every
    LoRA B matrix is made non-zero, so both adapters change the model."""
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=modules_to_save)
    policy = get_peft_model(base, config)
    policy.add_adapter(CRITIC_ADAPTER, policy.peft_config[POLICY_ADAPTER])
    policy.set_requires_grad([POLICY_ADAPTER, CRITIC_ADAPTER], True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator).to(param.dtype))
    return ActorCritic(policy, value_head=ValueHead(policy.config.hidden_size))


def merged_policy_only(policy) -> dict[str, torch.Tensor]:
    """What vLLM should hold: the base merged with the policy adapter alone (the others deleted first)."""
    alone = copy.deepcopy(policy)
    for adapter in [name for name in alone.peft_config if name != POLICY_ADAPTER]:
        alone.delete_adapter(adapter)
    return {name: p.detach() for name, p in alone.merge_and_unload().named_parameters()}


def trainer_logprobs(model, tokenizer, prompts, out: GenerationOutput, temperature: float) -> torch.Tensor:
    """Log-probs of the completions as the trainer computes them (`completion_logprobs`, left-padded prompts)."""
    from trl_vapo._compat import pad

    prompt_ids = pad([torch.tensor(p) for p in prompts], padding_value=tokenizer.pad_token_id, padding_side="left")
    prompt_mask = pad([torch.ones(len(p), dtype=torch.long) for p in prompts], padding_side="left")
    ids = torch.cat([prompt_ids, out.completion_ids], dim=1)
    attention = torch.cat([prompt_mask, out.completion_mask], dim=1)
    with torch.no_grad():
        return completion_logprobs(model, ids, attention, out.completion_ids.shape[1], temperature)


class StandInVLLMGeneration(VLLMGeneration):
    """TRL's `VLLMGeneration` with transformers in place of vLLM (see the module docstring). Same constructor and
    public methods; `sync_weights` is inherited unchanged."""

    def _init_vllm(self):
        # vLLM's colocate mode loads `model.name_or_path` itself: the base checkpoint, without any adapter.
        self.sampler = AutoModelForCausalLM.from_pretrained(self.model.name_or_path).eval()
        self.received: dict[str, torch.Tensor] = {}
        self.pushes = 0
        model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=self._load_weights))
        worker = SimpleNamespace(model_runner=model_runner)
        # vLLM's context: `max_model_len` given, else the model's (`max_position_embeddings`, from its config)
        context = self.max_model_length or self.sampler.config.max_position_embeddings
        engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=worker), model_config=SimpleNamespace(max_model_len=context)
        )
        self.llm = SimpleNamespace(llm_engine=engine, reset_prefix_cache=lambda: None)
        self._llm_weights_sleeping = False
        # vLLM's start seeds torch (and `random`, numpy) with the seed TRL gives `LLM`: the process's tensor-parallel
        # group's index.
        torch.manual_seed(self.accelerator.process_index // self.tensor_parallel_size)

    def _load_weights(self, weights):
        params = dict(self.sampler.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)  # KeyError on a name the model does not have
            self.received[name] = tensor.detach().clone()
        self.pushes += 1

    def generate(self, prompts, images, num_generations, profiler=None):
        """Like vLLM: greedy at temperature 0, stop at EOS and `stop_token_ids` (kept in the output), at a `stop`
        string (kept: TRL's requests include it, as the engine's) or where the prompt and the completion fill the
        context (`max_model_length`, else the model's), the sampled token's processed log-prob per position, shape
        (N, len, 1)."""
        stops = [self.processing_class.eos_token_id, *self.generation_kwargs.get("stop_token_ids", [])]
        completions, logprobs = [], []
        for prompt in prompts:  # one at a time: no padding to get wrong
            room = min(self.max_completion_length, self.llm.llm_engine.model_config.max_model_len - len(prompt))
            config = GenerationConfig(
                do_sample=self.temperature > 0,
                **(
                    {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
                    if self.temperature
                    else {}
                ),
                max_new_tokens=room,
                eos_token_id=stops,
                pad_token_id=self.processing_class.pad_token_id,
                stop_strings=self.generation_kwargs.get("stop"),  # vLLM's `stop`, kept in the output
            )
            with torch.no_grad():
                out = self.sampler.generate(
                    input_ids=torch.tensor([prompt]),
                    generation_config=config,
                    return_dict_in_generate=True,
                    output_scores=True,
                    tokenizer=self.processing_class,
                )
            tokens = out.sequences[0, len(prompt) :].tolist()
            scores = torch.stack(out.scores, dim=1)[0].float().log_softmax(-1)
            completions.append(tokens)
            logprobs.append([[scores[t, token].item()] for t, token in enumerate(tokens)])
        token_ids = [[[token] for token in row] for row in completions]
        return prompts, completions, logprobs, token_ids


class PoisonedTrainer(VAPOTrainer):
    """Makes the rewards of the rollouts listed in `poisoned` (0-based) NaN, so their returns and advantages, and
    those steps' loss: the critic's wherever its backward runs (the scoring pass, or the update), and the policy's."""

    poisoned: set[int] = set()

    def _make_rollout(self, rows, phase, *args, **kwargs):
        self.rollout_index = getattr(self, "rollout_index", -1) + 1
        return super()._make_rollout(rows, phase, *args, **kwargs)

    def _sequence_rewards(self, scores, group_size):
        rewards = super()._sequence_rewards(scores, group_size)
        return torch.full_like(rewards, math.nan) if self.rollout_index in self.poisoned else rewards


class LocalHub:
    """A stand-in for `huggingface_hub.HfApi` where the Hub cannot be reached (these machines): the two calls the
    Trainer makes, `create_repo` and `upload_folder`, with HfApi's own selection of a folder's files (its ignore
    patterns and defaults, `path_in_repo`), written to `root/<repo_id>/` when called; each upload recorded with its
    commit message; `delete_patterns`, HfApi's selection of the repository's files under `path_in_repo`, those the
    upload does not write removed."""

    def __init__(self, root):
        from huggingface_hub import HfApi

        self.root, self.api, self.commits = root, HfApi(endpoint="http://127.0.0.1:9"), []
        self.api._validate_yaml = lambda content, **kwargs: None  # the Hub's YAML check of a README: a request

    def create_repo(self, repo_id, **kwargs):
        from types import SimpleNamespace

        (self.root / repo_id).mkdir(parents=True, exist_ok=True)
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(
        self,
        *,
        repo_id,
        folder_path,
        path_in_repo=None,
        commit_message,
        ignore_patterns=None,
        delete_patterns=None,
        **kw,
    ):
        import shutil
        from concurrent.futures import Future

        from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

        ignore = [*(ignore_patterns or []), *DEFAULT_IGNORE_PATTERNS]
        added = self.api._prepare_upload_folder_additions(folder_path, path_in_repo or "", ignore_patterns=ignore)
        if delete_patterns:
            under = self.root / repo_id / (path_in_repo or "")
            present = (
                [p.relative_to(under).as_posix() for p in under.rglob("*") if p.is_file()] if under.is_dir() else []
            )
            written = {operation.path_in_repo for operation in added}
            for name in filter_repo_objects(present, allow_patterns=delete_patterns):
                if (Path(path_in_repo or "") / name).as_posix() not in written and name != ".gitattributes":
                    (under / name).unlink()
        for operation in added:
            target = self.root / repo_id / operation.path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(operation.path_or_fileobj, target)
        self.commits.append(commit_message)
        done = Future()
        done.set_result(None)
        return done if kw.get("run_as_future") else None


def put_in_hub_cache(cache: Path, repo_id: str, folders: dict[str, Path]) -> Path:
    """A Hub repository `repo_id` as huggingface_hub caches it (`models--owner--name/snapshots/<commit>/`, `refs/main`
    naming the commit), holding a copy of each of `folders` under its name: read offline as downloaded."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    for name, folder in folders.items():
        shutil.copytree(folder, snapshot / name, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(snapshot.name)
    return snapshot


def refuse_model_loads(monkeypatch) -> None:
    """Make loading any model (transformers' `from_pretrained`) fail the test: what must happen before it."""
    from transformers import PreTrainedModel

    def refuse(cls, *args, **kwargs):
        raise AssertionError(f"{cls.__name__}.from_pretrained ran: the check came after a model loaded")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))
