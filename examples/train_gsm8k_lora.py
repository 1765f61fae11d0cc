"""VAPO on GSM8K with LoRA: Qwen2.5-0.5B-Instruct on one GPU (`bench_gpu.py`'s LoRA step at these shapes, 8 x 8 x 512
tokens, peaked at 1.9 GiB on an H200 with micro-batches of 8; this script's micro-batches of 16 need more).

    pip install -e ".[tensorboard]"    # in a clone of trl-vapo
    python examples/train_gsm8k_lora.py

The policy and the critic are two LoRA adapters on one frozen copy of the base model; the reference policy (only
needed when beta > 0) is the base with adapters disabled.
"""

from datasets import load_dataset
from peft import LoraConfig

from trl_vapo import VAPOConfig, VAPOTrainer
from trl_vapo.data import BOXED_INSTRUCTION
from trl_vapo.rewards import math_reward

dataset = load_dataset("openai/gsm8k", "main", split="train")
# Chat prompts; the gold `answer` ("... #### 72") stays as a column for the reward function.
dataset = dataset.map(lambda row: {"prompt": [{"role": "user", "content": f"{row['question']}\n{BOXED_INSTRUCTION}"}]})

args = VAPOConfig(
    output_dir="Qwen2.5-0.5B-GSM8K-VAPO-LoRA",
    model_init_kwargs={"dtype": "bfloat16"},  # the frozen base in bf16, as gsm8k_lora.yaml loads it
    learning_rate=1e-5,  # LoRA adapters want a larger rate than full fine-tuning (paper: 1e-6, full weights)
    critic_learning_rate=2e-5,
    per_device_train_batch_size=16,
    gradient_accumulation_steps=4,  # 64 completions = 8 prompts x 8 samples per optimizer step
    num_generations=8,
    max_completion_length=512,
    max_steps=500,
    value_pretrain_steps=50,
    warmup_steps=10,
    activation_checkpointing=True,
    # bf16: on by default on a GPU with native bf16 (Ampere on); on a T4/V100: fp16=True, the dtype "float16"
    logging_steps=5,
    save_steps=100,
    report_to="tensorboard",
)
trainer = VAPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=math_reward,
    args=args,
    train_dataset=dataset,
    peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
)
trainer.train()
trainer.save_model()
