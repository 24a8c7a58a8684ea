"""ppoforge vs Stable-Baselines3 PPO on a classic-control task, side by side, one thread each.

Same hyperparameters on both sides (CleanRL's ppo.py CartPole defaults): 4 envs x 128 steps,
4 epochs x 4 minibatches, lr 2.5e-4 linearly annealed, gamma 0.99, lambda 0.95, clip 0.2, entropy 0.01,
value 0.5, grad-norm 0.5, 64-64 tanh actor and critic, Adam eps 1e-5. Each (framework, seed) runs in a
fresh subprocess with OMP_NUM_THREADS=1 and torch.set_num_threads(1), alternating frameworks so both
see the same machine load. SPS = environment steps / wall time of the training call (setup excluded).
Final return = mean return of the last 20 finished training episodes.

    python benchmarks/control_vs_sb3.py --steps 500000 --seeds 1,2,3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HP = dict(num_envs=4, num_steps=128, update_epochs=4, num_minibatches=4, learning_rate=2.5e-4, gamma=0.99,
          gae_lambda=0.95, clip_coef=0.2, ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5)


def run_ppoforge(env_id: str, steps: int, seed: int) -> dict:
    import tempfile

    from ppoforge.config import build_config
    from ppoforge.control.config import ControlConfig
    from ppoforge.control.trainer import ControlTrainer

    cfg = build_config(ControlConfig, {**HP, "env_id": env_id, "total_steps": steps, "seed": seed,
                                       "device": "cpu", "progress": False, "tensorboard": False,
                                       "checkpoint_every": 10**9})
    with tempfile.TemporaryDirectory(prefix="bench-ppoforge-") as run_dir:
        trainer = ControlTrainer(cfg, run_dir)
        start, cpu_start = time.perf_counter(), time.process_time()
        result = trainer.run()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return {"steps": result.global_step, "seconds": elapsed, "cpu_seconds": cpu, "returns": result.recent_returns[-20:]}


def run_sb3(env_id: str, steps: int, seed: int) -> dict:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.monitor import Monitor  # noqa: F401  (make_vec_env wraps envs in it)

    torch.set_num_threads(1)
    envs = make_vec_env(env_id, n_envs=HP["num_envs"], seed=seed)
    lr = HP["learning_rate"]
    model = PPO("MlpPolicy", envs, n_steps=HP["num_steps"],
                batch_size=HP["num_envs"] * HP["num_steps"] // HP["num_minibatches"],
                n_epochs=HP["update_epochs"], learning_rate=lambda frac: lr * frac, gamma=HP["gamma"],
                gae_lambda=HP["gae_lambda"], clip_range=HP["clip_coef"], clip_range_vf=HP["clip_coef"],
                ent_coef=HP["ent_coef"], vf_coef=HP["vf_coef"], max_grad_norm=HP["max_grad_norm"],
                policy_kwargs=dict(net_arch=dict(pi=[64, 64], vf=[64, 64]), activation_fn=torch.nn.Tanh),
                seed=seed, device="cpu", verbose=0)
    model.set_logger(Logger(folder=None, output_formats=[]))  # SB3's default would leave a /tmp/SB3-* folder
    start, cpu_start = time.perf_counter(), time.process_time()
    model.learn(total_timesteps=steps)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    returns = [ep["r"] for ep in model.ep_info_buffer][-20:]
    return {"steps": model.num_timesteps, "seconds": elapsed, "cpu_seconds": cpu, "returns": returns}


def _child(args) -> None:
    fn = run_ppoforge if args.framework == "ppoforge" else run_sb3
    print(json.dumps(fn(args.env, args.steps, args.seed)))


def _spawn(framework: str, env_id: str, steps: int, seed: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", framework, "--env", env_id, "--steps", str(steps),
           "--seed", str(seed)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="CartPole-v1", help="gymnasium env id")
    parser.add_argument("--steps", type=int, default=500_000, help="environment steps per run")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    parser.add_argument("--child", choices=["ppoforge", "sb3"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.framework = args.child
        return _child(args)
    rows = {"ppoforge": [], "sb3": []}
    for seed in (int(s) for s in args.seeds.split(",")):
        for framework in ("sb3", "ppoforge"):
            r = _spawn(framework, args.env, args.steps, seed)
            r["sps"], r["cpu_sps"] = r["steps"] / r["seconds"], r["steps"] / r["cpu_seconds"]
            r["final"] = statistics.fmean(r["returns"]) if r["returns"] else float("nan")
            rows[framework].append(r)
            print(f"{framework:>9} seed {seed}: {r['sps']:8,.0f} SPS ({r['cpu_sps']:,.0f} per CPU-second)  "
                  f"final return {r['final']:7.1f}", flush=True)
    print(f"\n{args.env}, {args.steps:,} steps, seeds {args.seeds}, one thread each")
    print("| framework | SPS (wall) | steps per CPU-second | final return per seed (last 20 episodes) |")
    print("|---|---|---|---|")
    for name, rs in rows.items():
        finals = ", ".join(f"{r['final']:.1f}" for r in rs)
        print(f"| {name} | {statistics.fmean(r['sps'] for r in rs):,.0f} | "
              f"{statistics.fmean(r['cpu_sps'] for r in rs):,.0f} | {finals} |")
    for key, label in (("sps", "wall-clock"), ("cpu_sps", "CPU-time")):
        ratio = statistics.fmean(r[key] for r in rows["ppoforge"]) / statistics.fmean(r[key] for r in rows["sb3"])
        print(f"SPS ratio ppoforge / SB3 ({label}): {ratio:.2f}x")


if __name__ == "__main__":
    main()
