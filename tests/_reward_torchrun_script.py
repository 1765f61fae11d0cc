"""Run by tests/test_rewards.py under ``torchrun --nproc_per_node 2``: every rank scores its own batch with the math
reward (real math-verify workers, one input that hangs on rank 1) and rank 0 writes all ranks' results as JSON."""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist

from trl_vapo.rewards import make_math_reward  # cheap: the rewards import no torch

GOLDS = ["#### 72", r"\frac{1}{2}", r"2\sqrt{3}", "(3,-1)", "x^2+7x", "5"]
COMPLETIONS = {
    0: [r"\boxed{72}", r"\boxed{0.5}", r"\boxed{\sqrt{12}}", r"\boxed{(-1,3)}", r"\boxed{x(x+7)}", r"\boxed{5}"],
    1: [
        r"\boxed{71}",
        r"\boxed{\dfrac12}",
        r"\boxed{2}",
        r"\boxed{(3, -1)}",
        r"\boxed{7x+x^2}",
        r"\boxed{9^{9^{9^{9}}}}",
    ],
}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    reward = make_math_reward(timeout=2.0, num_workers=1, name="torchrun_math_reward")
    reward.pool.warm_up()  # its worker's imports (sympy, math-verify) are not the deadline's to time
    start = time.monotonic()
    rewards = reward(completions=COMPLETIONS[rank], answer=GOLDS, prompts=[""] * len(GOLDS))
    elapsed = time.monotonic() - start
    record = {"rank": rank, "pid": os.getpid(), "rewards": rewards, "workers": reward.pool.worker_pids(), "s": elapsed}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
