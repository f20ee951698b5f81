from exgrpo_trl import ExGRPOConfig, ExGRPOTrainer
from exgrpo_trl.tasks.math_data import load_math_dataset
from exgrpo_trl.tasks.rewards import math_reward

# OpenR1-Math-46k, the paper's training set: a conversational "prompt" column and the reference "answer"
dataset = load_math_dataset("Elliott/Openr1-Math-46k-8192", split="train")

args = ExGRPOConfig(
    output_dir="Qwen2.5-Math-1.5B-ExGRPO",
    num_generations=8,
    per_device_train_batch_size=16,
    gradient_accumulation_steps=4,  # a generation batch of 64 rows: 8 questions, 4 of them replayed (replay_ratio 0.5)
    max_completion_length=1024,
    learning_rate=1e-6,
    loss_type="dr_grpo",
    scale_rewards="none",
)
trainer = ExGRPOTrainer(model="Qwen/Qwen2.5-Math-1.5B", reward_funcs=math_reward, args=args, train_dataset=dataset)
trainer.train()
