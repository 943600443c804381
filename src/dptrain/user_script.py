"""A training script of the user's own, as given after `--` (`dptrain submit -- my_train.py --epochs 5`, `dptrain
train --nproc-per-node 2 -- my_train.py --epochs 5`): the script or module, its arguments, and the interpreter named
before it, read the same way for a SLURM job (slurm/user_script.py) and for local workers (launch/user_script.py).

What follows `--` is what follows torchrun's own options: a script and its arguments (my_train.py --epochs 5), or
-m and a module. A leading python (srun python my_train.py, the tutorials' sbatch habit) names the interpreter.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from dptrain.config import OutputConfig, RunConfig
from dptrain.errors import ConfigError

PYTHON_WORD = re.compile(r"python(\d+(\.\d+)?)?")  # python, python3, python3.11, as a word or a path's last part


@dataclass(frozen=True)
class UserScript:
    """The user's training command, as given after `--`."""

    target: tuple[str, ...]
    """The script (my_train.py), or -m and a module (-m pkg.train)."""
    args: tuple[str, ...]
    """The script's own arguments, passed on as given."""
    python: str | None = None
    """The interpreter named before the script (python, /opt/venv/bin/python), if any."""

    @property
    def name(self) -> str:
        """A run name after the script: my_train for my_train.py, train for -m pkg.train."""
        stem = self.target[-1].rsplit(".", 1)[-1] if self.target[0] == "-m" else Path(self.target[0]).stem
        return re.sub(r"[^A-Za-z0-9._-]", "_", stem).lstrip(".-") or "script"

    @property
    def shown(self) -> str:
        return shlex.join([*self.target, *self.args])


def from_words(words: list[str], workdir: Path, example: str, runner: str) -> UserScript:
    """The user's command after `--` (words), its script looked for from workdir, where runner ('the job') runs it;
    ConfigError in one sentence where there is no script, or no such file. example: a whole command line to show."""
    command = " ".join(example.split()[:2])  # dptrain submit
    python = None
    if words and PYTHON_WORD.fullmatch(Path(words[0]).name):
        python, words = words[0], words[1:]
    if words[:1] == ["-u"]:  # unbuffered output: torchrun runs its workers with python -u already
        words = words[1:]
    if not words:
        raise ConfigError(f"no training script after --; give the script and its arguments as torchrun takes them, "
                          f"e.g. {example}.")
    if words[0] == "-m":
        if len(words) < 2:
            raise ConfigError(f"-m after -- needs a module to run, e.g. {command} -- -m mypackage.train.")
        return UserScript(tuple(words[:2]), tuple(words[2:]), python)
    if words[0].startswith("-"):
        raise ConfigError(f"{words[0]} after -- is an option, not a training script; put {command}'s options before --, "
                          f"and the script and its arguments after it, e.g. {example}.")
    script = Path(words[0]).expanduser()
    if not (script if script.is_absolute() else workdir / script).is_file():
        raise ConfigError(f"the training script {words[0]} is not a file in {workdir}, where {runner} runs it; give "
                          f"its path from there.")
    return UserScript((words[0],), tuple(words[1:]), python)


def refuse_trainer_options(pairs: list[tuple[str, str]], sections: tuple[str, ...], what: str) -> None:
    """ConfigError in one sentence for an option of dptrain's own trainer (--train.epochs) given with a script of the
    user's, which would not read it. sections: those whose options still mean something; what: 'this job', ..."""
    for key, _ in pairs:
        if key.partition(".")[0] not in sections:
            raise ConfigError(f"--{key} is an option of dptrain's own trainer, which {what} does not run; give your "
                              f"script its own options after its name (-- my_train.py --epochs 5).")


def named_after(cfg: RunConfig, script: UserScript, pairs: list[tuple[str, str]]) -> RunConfig:
    """cfg with its run folder runs/<the script's name> (runs/my_train, not one named after the trainer's options,
    which a script does not take), where no --output.* option and no file's [output] table chose another."""
    if any(key.startswith("output.") for key, _ in pairs) or cfg.output.dir is not None or \
            cfg.output.name != OutputConfig().name:
        return cfg
    return dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, name=script.name))
