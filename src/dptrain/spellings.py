"""The tutorials' spellings of dptrain's options, and a "did you mean" for any other unknown one.

Users come from scripts that take `--epochs 5 --batch_size 64 --lr 0.01` and from torchrun's underscore flags
(`--nproc_per_node`) and multi-node line (`--rdzv_backend c10d --rdzv_endpoint HOST:PORT --rdzv_id ID`); DeepSpeed's
launcher adds `--local_rank=N` to every worker's command line. Each of those is read as dptrain's own option (one
note on stderr says which, so the user learns it), taken with a note that says what dptrain does with it (torchrun's
rendezvous backend and id), or refused in one sentence where no option means the same thing (a per-process batch is
not dptrain's global batch; a rendezvous other than c10d).
"""

from __future__ import annotations

import difflib
import sys

from dptrain import config as config_mod
from dptrain.config import LEGACY_STRATEGY_KEYS
from dptrain.errors import ConfigError

ALIASES = {
    # the tutorials' training flags -> dptrain's options of the same meaning
    "--epochs": "--train.epochs", "--num_epochs": "--train.epochs", "--num-epochs": "--train.epochs",
    "--lr": "--optim.lr", "--learning_rate": "--optim.lr", "--learning-rate": "--optim.lr",
    "--seed": "--train.seed", "--random_seed": "--train.seed", "--random-seed": "--train.seed",
    "--model_dir": "--output.weights_dir", "--model-dir": "--output.weights_dir",
    "--model_filename": "--output.weights_file", "--model-filename": "--output.weights_file",
    "--batch_size": "--train.batch_size_per_rank", "--batch-size": "--train.batch_size_per_rank",
    # Lightning's Trainer(accumulate_grad_batches=N), as its scripts take it on their command lines
    "--accumulate_grad_batches": "--train.accumulate_steps", "--accumulate-grad-batches": "--train.accumulate_steps",
    # torchrun's underscore spellings of the flags `dptrain train` shares with it
    "--nproc_per_node": "--nproc-per-node", "--node_rank": "--node-rank", "--master_addr": "--master-addr",
    "--master_port": "--master-port", "--rdzv_endpoint": "--rdzv-endpoint",
    # DeepSpeed's own flags, as its examples pass them
    "--deepspeed_config": "--strategy.deepspeed.config",
}
WHAT_IT_MEANS = {
    "--output.weights_dir": "the final weights are saved there, as the tutorials' scripts save them; the run's own "
                            "folder (snapshots, logs, resumed from) stays --output.dir, runs/<name> by default",
    "--output.weights_file": "the final weights' file name, in --output.weights_dir (the run's folder by default)",
}
"""A second half of the note for an alias whose dptrain option is not what the name alone suggests: the tutorials'
--model_dir is where their script saves the model, not a run's folder, and --model_filename no architecture."""
SWITCHES = {"--deepspeed": ["--strategy.name", "deepspeed"]}
"""Flags without a value that mean an option and its value."""
SBATCH_LINES = ("--gpus-per-task",)
"""sbatch's GPU request that `dptrain submit` has no option of its own for (its --gres and --gpus are its own): taken
as an --sbatch line."""
IGNORED = ("--local_rank", "--local-rank")
"""What a launcher adds to every worker's command line (DeepSpeed's: --local_rank=N); dptrain reads LOCAL_RANK."""
RENDEZVOUS_BACKEND = ("--rdzv_backend", "--rdzv-backend")
"""torchrun's choice of rendezvous: dptrain's nodes always meet through c10d's, hosted by node 0 at --rdzv-endpoint."""
RENDEZVOUS_ID = ("--rdzv_id", "--rdzv-id")
"""torchrun's name of a run in a shared rendezvous store: dptrain's store, on node 0's endpoint, serves one run only."""
REFUSED = {
    "--gpus": "counts GPUs in the tutorials; dptrain starts one worker per GPU: give --nproc-per-node N here, or "
              "--gpus-per-node N to dptrain submit",
}


def translate(argv: list[str]) -> list[str]:
    """argv with the tutorials' spellings replaced by dptrain's (a note each on stderr) and a launcher's --local_rank
    dropped; ConfigError for a spelling that has no equal here."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in IGNORED:
            i += 1 if eq or i + 1 >= len(argv) or argv[i + 1].startswith("-") else 2
            continue
        if flag in REFUSED:
            raise ConfigError(f"{flag} {REFUSED[flag]}.")
        if flag in RENDEZVOUS_BACKEND or flag in RENDEZVOUS_ID:
            value, i = _value_of(flag, argv, i, eq, value)
            print(f"dptrain: note: {_rendezvous_note(flag, value)}", file=sys.stderr)
            i += 1
            continue
        if flag in SBATCH_LINES:
            value, i = (value, i) if eq else (argv[i + 1] if i + 1 < len(argv) else "", i + 1)
            line = f"{flag.removeprefix('--')}={value}"
            print(f"dptrain: note: {flag} {value} is read as --sbatch {line}, its name here.", file=sys.stderr)
            out.extend(["--sbatch", line])
            i += 1
            continue
        if flag in SWITCHES and not eq:
            print(f"dptrain: note: {flag} is read as {' '.join(SWITCHES[flag])}, its name here.", file=sys.stderr)
            out.extend(SWITCHES[flag])
            i += 1
            continue
        if flag in ALIASES:
            meaning = f": {WHAT_IT_MEANS[ALIASES[flag]]}" if ALIASES[flag] in WHAT_IT_MEANS else ""
            print(f"dptrain: note: {flag} is read as {ALIASES[flag]}, its name here{meaning}.", file=sys.stderr)
            out.append(ALIASES[flag] + (eq + value if eq else ""))
        else:
            out.append(argv[i])
        i += 1
    return out


def _value_of(flag: str, argv: list[str], i: int, eq: str, value: str) -> tuple[str, int]:
    """(the value of the flag at argv[i], given as --flag=VALUE or --flag VALUE, and the index of its last word);
    ConfigError where none follows."""
    if eq:
        return value, i
    if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
        raise ConfigError(f"{flag} needs a value, as torchrun's does; write e.g. {flag} "
                          f"{'c10d' if flag in RENDEZVOUS_BACKEND else 'job42'}.")
    return argv[i + 1], i + 1


def _rendezvous_note(flag: str, value: str) -> str:
    """What dptrain does with torchrun's --rdzv_backend VALUE or --rdzv_id VALUE (a note), or ConfigError for a
    rendezvous it does not have."""
    if flag in RENDEZVOUS_BACKEND:
        if value != "c10d":
            raise ConfigError(f"{flag} {value} is not a rendezvous dptrain has: its nodes always meet through c10d's, "
                              f"hosted by node 0 at --rdzv-endpoint HOST:PORT; give {flag} c10d, or leave it out.")
        return (f"{flag} c10d is the rendezvous dptrain's nodes always use (hosted by node 0 at --rdzv-endpoint); "
                f"nothing to set.")
    return (f"{flag} {value} is ignored: the rendezvous store that node 0 hosts at --rdzv-endpoint serves this one run "
            f"(a second run at once needs another port), so no run id is needed.")


def known_keys() -> list[str]:
    """Every --section.option, and the strategy keys of before the tables: the config refuses those with their new
    spelling, which reaching it gives instead of a did-you-mean."""
    keys = [f"{o.section}.{o.name}" for o in config_mod.options()]
    return keys + [f"strategy.{old}" for old in LEGACY_STRATEGY_KEYS]


def check_known(pairs: list[tuple[str, str]]) -> None:
    """ConfigError with the closest option's name for a key that is no option (--train.epoch -> --train.epochs);
    keys close to none are left to the config's own sentence, which lists what there is."""
    keys = known_keys()
    for key, _ in pairs:
        if key in keys:
            continue
        close = difflib.get_close_matches(key, keys + [a.removeprefix("--") for a in ALIASES], n=1, cutoff=0.75)
        if close:
            name = ALIASES.get(f"--{close[0]}", f"--{close[0]}")
            raise ConfigError(f"unknown option --{key}; did you mean {name}?")


def help_text() -> str:
    """The aliases, for --help."""
    by_target: dict[str, list[str]] = {}
    for alias, target in ALIASES.items():
        by_target.setdefault(target, []).append(alias)
    listed = "; ".join([*(f"{', '.join(aliases)} for {target}" for target, aliases in by_target.items()),
                        *(f"{switch} for {' '.join(meaning)}" for switch, meaning in SWITCHES.items()),
                        *(f"{flag} X for --sbatch {flag.removeprefix('--')}=X" for flag in SBATCH_LINES)])
    return (f"The tutorials' spellings are read too: {listed}. A launcher's --local_rank is ignored (LOCAL_RANK is "
            f"read); so are torchrun's --rdzv_backend c10d (the rendezvous dptrain's nodes use) and --rdzv_id (node "
            f"0's rendezvous store serves one run). --gpus is answered with dptrain's option of its meaning.")
