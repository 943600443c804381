"""The docs' commands still parse: every `dptrain train | config | submit | bench | doctor` in README.md and docs/*.md.

Each command goes through the CLI's own parser (`build_parser`) and, for its --section.option overrides and the
TOML file a page writes for it, through `config.load`, as the command itself would; nothing is started. A renamed
flag, a removed option or a value the config refuses fails here, naming the page and line. So does an old flat
key such as --strategy.comm_hook: the config still reads those for one release, but the docs must show the new ones.

What this leaves out: whether the run would succeed (data on disk, the world size dividing the batch, a cluster),
which `dptrain train --dry-run` checks by hand; and the sample outputs (`$ dptrain ...` lines in plain ``` blocks),
some of which show refused commands on purpose.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from dptrain import config as config_mod
from dptrain.cli import build_parser, split_overrides, submit_overrides, translated
from dptrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKED = ("train", "config", "submit", "bench")
# `dptrain report BENCH_DIR`, `--nproc-per-node N`: a placeholder stands for a value the reader picks (a job
# script's `$SLURM_NNODES` for one the job fills in).
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(\.\.\.)?$")
INLINE_CODE = re.compile(r"`([^`]+)`")
HEREDOC = re.compile(r"^cat > (\S+) <<'?(\w+)'?$")


@dataclass(frozen=True)
class Command:
    where: str  # page:line
    argv: list[str]  # after `dptrain`
    files: dict[str, str]  # the TOML files the page writes before it: name -> text


def dptrain_argv(text: str) -> list[str] | None:
    """The arguments after `dptrain` of the first command of a shell line that runs it (`setup.sh && dptrain ...`,
    `dptrain config ... > run.toml`: up to the operator), or None where none does."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)  # ;&|<> come out as tokens of their own
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        words = list(lexer)
    except ValueError:  # an unbalanced quote: prose, not a command
        return None
    commands, current = [], []
    for word in words:
        if word and set(word) <= set(";&|<>()"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    for command in [*commands, current]:
        while command and re.match(r"^[A-Z_]+=", command[0]):  # PYTHONPATH=. dptrain ...
            command = command[1:]
        if command and command[0] in ("dptrain", ".venv/bin/dptrain"):
            return command[1:]
        # `python -m dptrain ...`, also behind a launcher (`srun [its options] .venv/bin/python -m dptrain train ...`)
        for i in range(len(command) - 2):
            if re.search(r"(^|/)python3?$", command[i]) and command[i + 1:i + 3] == ["-m", "dptrain"]:
                return command[i + 3:]
    return None


def read_page(page: Path) -> tuple[list[Command], dict[str, str]]:
    """The dptrain commands of one page: the lines of its ```bash blocks (backslash continuations joined) and its
    inline `dptrain ...` spans, with the TOML files the page defines (a ```toml block headed `# NAME: ...`, or a
    `cat > NAME <<'TAG'` here-document)."""
    where_of = str(page.relative_to(ROOT))
    lines = page.read_text(encoding="utf-8").split("\n")
    found: list[tuple[int, str]] = []
    defined: list[tuple[int, str, str]] = []  # (line, file name, text) of each TOML file the page writes
    fence, block, prose = None, [], []  # block: (line number, text) of the open fence's lines

    def close_block() -> None:
        if fence == "toml" and block and (head := re.match(r"#\s*(\S+?):?\s", block[0][1] + " ")):
            defined.append((block[0][0], head.group(1), "\n".join(text for _, text in block)))
        if fence != "bash":
            return
        heredoc, joined, start = None, "", 0
        for number, text in block:
            if heredoc:
                name, tag, body, begin = heredoc
                if text.strip() == tag:
                    defined.append((begin, name, "\n".join(body)))
                    heredoc = None
                else:
                    body.append(text)
                continue
            if match := HEREDOC.match(text.strip()):
                heredoc = (match.group(1), match.group(2), [], number)
                continue
            start = start or number
            if text.rstrip().endswith("\\"):
                joined += text.rstrip()[:-1] + " "
                continue
            found.append((start, joined + text))
            joined, start = "", 0

    def close_paragraph() -> None:
        text = " ".join(t for _, t in prose)
        for match in INLINE_CODE.finditer(text):
            # the line of the span's start: count the characters of the paragraph's lines before it
            offset, number = match.start(), prose[0][0]
            for line_number, line in prose:
                if offset <= len(line):
                    number = line_number
                    break
                offset -= len(line) + 1
            found.append((number, match.group(1)))
        prose.clear()

    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            if fence is None:
                close_paragraph()
                fence, block = line.strip()[3:].strip() or "-", []
            else:
                close_block()
                fence = None
        elif fence is not None:
            block.append((number, line))
        elif line.strip():
            prose.append((number, line))
        else:
            close_paragraph()
    close_paragraph()

    commands = []
    for number, text in found:
        argv = dptrain_argv(text)
        if (not argv or argv[0] not in CHECKED or "--help" in argv
                or any(PLACEHOLDER.match(w) or "$" in w for w in argv)):
            continue
        files_before = {name: body for line, name, body in defined if line < number}
        commands.append(Command(f"{where_of}:{number}", argv, files_before))
    return commands, {name: text for _, name, text in defined}


# A command that runs only once the page's own steps are taken: extending.md trains the strategy it adds, which
# tests/test_extending.py does for real, in a copy of the repository.
AFTER_THE_PAGES_STEPS = {"docs/extending.md": "ddp_split"}
COMMANDS = [command for page in PAGES for command in read_page(page)[0]
            if AFTER_THE_PAGES_STEPS.get(command.where.split(":")[0]) not in command.argv]


def check_command(command: Command, tmp_path: Path) -> None:
    """Parse the command as the CLI does and load its config; raise with the page and line on any mistake."""
    try:  # the tutorials' spellings a page shows on purpose are read as main() reads them
        args, extra = build_parser().parse_known_args(translated(command.argv))
    except SystemExit:  # argparse has printed its error (an unknown flag, a bad value) to stderr
        pytest.fail(f"{command.where}: `dptrain {' '.join(command.argv)}` is refused by the command line parser")
    if args.func.__name__ == "cmd_bench":  # the lab's subcommands parse the words after `bench` themselves
        from dptrain_bench.cli import parse_bench

        try:
            args, pairs = parse_bench(extra)
        except (SystemExit, ConfigError) as exc:
            pytest.fail(f"{command.where}: `dptrain {' '.join(command.argv)}` is refused by `dptrain bench` ({exc})")
    else:
        pairs = split_overrides(extra)
    stale = [key for key, _ in pairs if config_mod.current_name(key) != key]
    assert not stale, f"{command.where}: --{stale[0]} is an old key; write --{config_mod.current_name(stale[0])}"
    if getattr(args, "func", None) is not None and args.func.__name__ == "cmd_submit":
        pairs += submit_overrides(args)
    elif getattr(args, "nproc_per_node", None) is not None:
        pairs.append(("launch.nproc_per_node", str(args.nproc_per_node)))
    path = None
    config = getattr(args, "config", None)  # the probes take no --config
    if config is not None and config in command.files:
        path = tmp_path / Path(config).name
        path.write_text(command.files[config])
    # a --config the page does not write (a job's job.toml) is the run's own: its options are checked where written
    config_mod.load(path, pairs)


def test_the_docs_have_commands_to_check():
    """An extraction that found next to nothing would pass every check below without checking anything."""
    pages = {command.where.split(":")[0] for command in COMMANDS}
    assert len(COMMANDS) >= 40 and {"README.md", "docs/strategies.md", "docs/clusters.md", "docs/benchmark.md"} <= pages


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_doc_command_parses(command, tmp_path):
    check_command(command, tmp_path)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_doc_toml_files_use_current_keys(page, tmp_path):
    """The TOML files a page shows load, with no flat [strategy] key of before the strategy tables."""
    for name, text in read_page(page)[1].items():
        strategy = tomllib.loads(text).get("strategy", {})
        stale = [f"strategy.{key}" for key, value in strategy.items() if not isinstance(value, dict)
                 and config_mod.current_name(f"strategy.{key}") != f"strategy.{key}"]
        assert not stale, f"{page.name}'s {name} sets {stale[0]}; write {config_mod.current_name(stale[0])}"
        (tmp_path / "file.toml").write_text(text)
        config_mod.load(tmp_path / "file.toml")


def test_an_old_flat_key_in_a_doc_command_fails(tmp_path):
    """The check above catches the drift this file exists for: the old key is refused, with its new spelling."""
    old = Command("example.md:1", ["train", "--strategy.comm_hook", "fp16"], {})
    with pytest.raises(AssertionError, match="strategy.comm_hook is an old key; write --strategy.ddp.comm_hook"):
        check_command(old, tmp_path)
    with pytest.raises(ConfigError, match="--strategy.comm_hook is no option: each strategy's options sit in its own "
                                          "table; write --strategy.ddp.comm_hook instead"):
        config_mod.load(None, split_overrides(old.argv[1:]))


def test_an_unknown_option_in_a_doc_command_fails(tmp_path):
    with pytest.raises(ConfigError, match="unknown option --optim.lrr; did you mean --optim.lr"):
        check_command(Command("example.md:1", ["config", "--optim.lrr", "0.1"], {}), tmp_path)


def test_python_m_dptrain_lines_are_checked_too_behind_a_launcher():
    assert dptrain_argv("srun --kill-on-bad-exit=1 /home/a/.venv/bin/python -m dptrain train --config r.toml") == [
        "train", "--config", "r.toml"]
    assert dptrain_argv("PYTHONPATH=src python3 -m dptrain config --optim.lr 0.1 > run.toml") == [
        "config", "--optim.lr", "0.1"]
    assert dptrain_argv("python -m dptrain_bench.link --world 2") is None  # the lab's internal entry, not the CLI
