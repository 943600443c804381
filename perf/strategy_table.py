"""Memory and traffic per rank for every strategy, as a markdown table (the README's table).

Runs `dptrain train` for a few steps of mnist-cnn with Adam on synthetic 1x28x28 data for each
strategy and world size, and reads the accounting fields of the epoch event. The figures do not
depend on the data, only on the model, the optimizer and the strategy.

    python perf/strategy_table.py --worlds 2 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

STRATEGIES = {
    "ddp": [],
    "ddp, gloo's all-reduce": ["--strategy.ddp.shared_memory", "false"],
    "ddp + fp16 hook": ["--strategy.ddp.comm_hook", "fp16"],
    "ddp + powersgd hook": ["--strategy.ddp.comm_hook", "powersgd"],
    "ddp + ring hook": ["--strategy.ddp.comm_hook", "ring"],
    "zero1": ["--strategy.name", "zero1"],
    "fsdp (reshard: ZeRO-3)": ["--strategy.name", "fsdp"],
    "fsdp (no reshard: ZeRO-2)": ["--strategy.name", "fsdp", "--strategy.fsdp.reshard_after_forward", "false"],
    "ps": ["--strategy.name", "ps"],
    "ps (dedicated server)": ["--strategy.name", "ps", "--strategy.ps.dedicated_server", "true"],
}


def mib(values: list[int]) -> str:
    """'4.58' when every rank shows the same, else 'rank0 / rank1 / ...'."""
    shown = [f"{v / 2**20:.2f}" for v in values]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def measure(world: int, args: list[str], model: str) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run(
            [sys.executable, "-m", "dptrain", "train", "--nproc-per-node", str(world), "--data.name", "synthetic",
             "--model.name", model, "--train.max_steps", "4", "--train.global_batch_size", "48",
             "--output.dir", run_dir, *args],
            check=True, capture_output=True, text=True, timeout=600,
        )
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == "epoch"][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--model", default="mnist-cnn")
    args = parser.parse_args()
    print("| strategy | ranks | params MiB | grads MiB | optimizer state MiB | sent per step MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, extra in STRATEGIES.items():
        for world in args.worlds:
            e = measure(world, extra, args.model)
            print(f"| {name} | {world} | {mib(e['mem_params_bytes'])} | {mib(e['mem_grads_bytes'])} | "
                  f"{mib(e['mem_optim_bytes'])} | {mib(e['comm_bytes_per_step'])} |", flush=True)


if __name__ == "__main__":
    main()
