"""Replays a Dockerfile outside a container, where no engine runs and no base image can be
pulled: the same instructions, read from the file itself so the two cannot drift.

Each stage gets a folder standing for its filesystem, seeded as the base image would be (the
Python interpreter at /usr/local/bin, here the host's interpreter of the same minor release).
Paths the Dockerfile owns (its WORKDIRs, the absolute values of its ENVs, /usr/local/bin) live
in that folder; everything else (/bin/sh, /usr/bin) is the host's. COPY copies from the build
context (honouring .dockerignore) or from another stage's folder; RUN runs the command with
/bin/sh -c in the stage's environment and working directory (a cache mount is the host's own
pip cache); ENTRYPOINT and CMD give the command a container would start with.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# What the official Python images set (docker inspect python:3.11-slim).
BASE_PATH = "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"
BASE_PYTHON = "/usr/local/bin"
_VARIABLE = re.compile(r"\$\{(\w+)(?::([-+])([^}]*))?\}|\$(\w+)")


def _host_node() -> str:
    """The host's Node.js major release ("" without one)."""
    node = shutil.which("node")
    if node is None:
        return ""
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    return version.stdout.strip().lstrip("v").split(".")[0]


# What the official Node.js images put on PATH, here the host's own.
_NODE_TOOLS = {name: shutil.which(name) or f"/usr/bin/{name}" for name in ("node", "npm", "npx")}


class ReplayError(AssertionError):
    """A Dockerfile step that cannot be replayed, or that failed."""


@dataclass(frozen=True)
class Instruction:
    """One instruction: its keyword, its --flags and the rest of its line."""

    keyword: str
    flags: dict[str, str]
    args: str
    line: int


@dataclass
class Stage:
    """A FROM and what follows it."""

    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        """Its instructions with `keyword`."""
        return [i for i in self.instructions if i.keyword == keyword]


def parse(text: str) -> list[Stage]:
    """The stages of a Dockerfile (line continuations joined, comments dropped)."""
    stages: list[Stage] = []
    logical: list[tuple[int, str]] = []
    pending = ""
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # Docker drops comment lines, within a continuation too
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append((start, pending + stripped))
        pending = ""
    for number, line in logical:
        keyword, _, rest = line.partition(" ")
        flags: dict[str, str] = {}
        rest = rest.strip()
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            key, _, value = flag[2:].partition("=")
            flags[key] = value
            rest = rest.strip()
        instruction = Instruction(keyword.upper(), flags, rest, number)
        if instruction.keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(words[0], name))
        elif not stages:
            raise ReplayError(f"line {number}: {keyword} before any FROM is not replayed")
        else:
            stages[-1].instructions.append(instruction)
    return stages


def expand(text: str, env: Mapping[str, str]) -> str:
    """Docker's variable substitution: $VAR, ${VAR}, ${VAR:-default}, ${VAR:+alternative}."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(4)
        current = env.get(name, "")
        if match.group(2) == "-":
            return current or match.group(3)
        if match.group(2) == "+":
            return match.group(3) if current else ""
        return current

    return _VARIABLE.sub(value, text)


def exec_form(instruction: Instruction) -> list[str]:
    """An ENTRYPOINT or CMD in exec form (a JSON array); the shell form is refused."""
    try:
        words = json.loads(instruction.args)
    except json.JSONDecodeError:
        words = None
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise ReplayError(f"line {instruction.line}: {instruction.keyword} must be a JSON array")
    return words


def _ignored(relative: str, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves `relative` out of the context (last matching rule wins)."""
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        rule = pattern[1:] if negated else pattern
        rule = rule.rstrip("/")
        candidates = [relative]
        parts = relative.split("/")
        # A rule for a folder covers what is in it.
        candidates += ["/".join(parts[:n]) for n in range(1, len(parts))]
        if rule.startswith("**/"):
            tail = rule[3:]
            hit = any(fnmatch.fnmatchcase(p, tail) for p in parts)
        else:
            hit = any(fnmatch.fnmatchcase(c, rule) for c in candidates)
        if hit:
            ignored = not negated
    return ignored


class Replay:
    """A Dockerfile's stages replayed into `workdir`, one folder per stage."""

    def __init__(self, context: Path, workdir: Path, build_args: Mapping[str, str]) -> None:
        self.context = context
        self.workdir = workdir
        self.build_args = dict(build_args)
        self.stages = parse((context / "Dockerfile").read_text())
        ignore = context / ".dockerignore"
        self._ignore = [
            line.strip()
            for line in (ignore.read_text().splitlines() if ignore.exists() else [])
            if line.strip() and not line.lstrip().startswith("#")
        ]
        self._owned = self._owned_prefixes()
        self.env: dict[str, dict[str, str]] = {}
        self.cwd: dict[str, str] = {}
        self.user: dict[str, str] = {}

    def _owned_prefixes(self) -> list[str]:
        """Image paths the Dockerfile itself makes or names: they live in a stage's folder."""
        owned = {BASE_PYTHON}
        for stage in self.stages:
            for instruction in stage.instructions:
                if instruction.keyword == "WORKDIR":
                    owned.add(instruction.args)
                if instruction.keyword == "ENV":
                    for word in shlex.split(instruction.args):
                        _, _, value = word.partition("=")
                        if value.startswith("/"):
                            owned.add(value)
        owned.discard("/")
        return sorted(owned, key=len, reverse=True)

    def root(self, stage: str) -> Path:
        """The folder standing for `stage`'s filesystem."""
        return self.workdir / stage

    def host_path(self, stage: str, image_path: str) -> str:
        """Where an image path of `stage` is here."""
        if image_path == "/":
            return str(self.root(stage))
        for prefix in self._owned:
            if image_path == prefix or image_path.startswith(prefix + "/"):
                return str(self.root(stage)) + image_path
        return image_path

    def host_env(self, stage: str) -> dict[str, str]:
        """`stage`'s environment as a process here sees it: every owned path mapped (path
        lists too), over the host's environment (for pip's index, certificates and cache)."""
        mapped = {}
        for key, value in self.env[stage].items():
            mapped[key] = ":".join(
                self.host_path(stage, part) if part.startswith("/") else part
                for part in value.split(":")
            )
        return {**os.environ, **mapped}

    def run_all(self, *, log: Path) -> None:
        """Replay every stage in order; each RUN's output goes to `log`."""
        for stage in self.stages:
            self._replay(stage, log)

    def _seed(self, stage: Stage) -> None:
        """The base image: its PATH and its runtime, Python or Node.js (the host's, of the same
        minor release for Python, the same major release for Node.js)."""
        tag = stage.base.split("@")[0].rpartition(":")[2]
        release = tag.split("-")[0].split(".")
        if stage.base.startswith("node:"):
            here, wanted, tools = _host_node(), release[0], _NODE_TOOLS
        else:
            here = f"{sys.version_info.major}.{sys.version_info.minor}"
            wanted = ".".join(release[:2]) if stage.base.startswith("python:") else "?"
            interpreter = getattr(sys, "_base_executable", sys.executable)
            tools = {"python": interpreter, "python3": interpreter}
        if wanted != here:
            raise ReplayError(
                f"stage {stage.name}: base {stage.base} is not Python {sys.version_info.major}."
                f"{sys.version_info.minor} or Node.js {_host_node()}, the runtimes this replay "
                "stands in with"
            )
        bin_dir = Path(self.host_path(stage.name, BASE_PYTHON))
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name, target in tools.items():
            (bin_dir / name).symlink_to(target)
        self.env[stage.name] = {"PATH": BASE_PATH}
        self.cwd[stage.name] = "/"

    def _replay(self, stage: Stage, log: Path) -> None:
        self._seed(stage)
        args: dict[str, str] = {}
        for instruction in stage.instructions:
            scope = {**args, **self.env[stage.name]}
            keyword = instruction.keyword
            if keyword == "ARG":
                name, _, default = instruction.args.partition("=")
                args[name] = self.build_args.get(name, default)
            elif keyword == "ENV":
                for word in shlex.split(instruction.args):
                    key, _, value = word.partition("=")
                    self.env[stage.name][key] = expand(value, scope)
            elif keyword == "WORKDIR":
                self.cwd[stage.name] = expand(instruction.args, scope)
                Path(self.host_path(stage.name, self.cwd[stage.name])).mkdir(
                    parents=True, exist_ok=True
                )
            elif keyword == "COPY":
                self._copy(stage.name, instruction, scope)
            elif keyword == "RUN":
                self._run(stage.name, instruction, args, log)
            elif keyword == "USER":
                self.user[stage.name] = expand(instruction.args, scope)
            elif keyword not in ("EXPOSE", "ENTRYPOINT", "CMD", "LABEL"):
                raise ReplayError(f"line {instruction.line}: {keyword} is not replayed")

    def _image_path(self, stage: str, path: str) -> str:
        return path if path.startswith("/") else os.path.join(self.cwd[stage], path)

    def _copy(self, stage: str, instruction: Instruction, scope: Mapping[str, str]) -> None:
        words = [expand(w, scope) for w in shlex.split(instruction.args)]
        *sources, dest = words
        target = Path(self.host_path(stage, self._image_path(stage, dest)))
        source_stage = instruction.flags.get("from")
        for source in sources:
            if source_stage is not None:
                origin = Path(self.host_path(source_stage, source))
            else:
                origin = self.context / source
            if not origin.exists():
                raise ReplayError(f"line {instruction.line}: COPY {source}: no such file")
            into = target / origin.name if dest.endswith("/") and origin.is_file() else target
            if origin.is_dir():
                self._copy_tree(origin, into, from_context=source_stage is None)
            else:
                into.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, into)

    def _copy_tree(self, origin: Path, into: Path, *, from_context: bool) -> None:
        def ignore(folder: str, names: list[str]) -> set[str]:
            if not from_context:
                return set()
            base = Path(folder).relative_to(self.context).as_posix()
            prefix = "" if base == "." else base + "/"
            return {n for n in names if _ignored(prefix + n, self._ignore)}

        shutil.copytree(origin, into, symlinks=True, ignore=ignore, dirs_exist_ok=True)

    def _run(
        self, stage: str, instruction: Instruction, args: Mapping[str, str], log: Path
    ) -> None:
        for prefix in self._owned:
            if re.search(rf"(?<![\w$}}/]){re.escape(prefix)}(?![\w-])", instruction.args):
                raise ReplayError(
                    f"line {instruction.line}: RUN names {prefix} literally; use its variable "
                    "so the replay runs it in the stage's folder, not on this machine"
                )
        env = {**self.host_env(stage), **args}
        with log.open("a") as out:
            out.write(f"\n### {stage} line {instruction.line}: RUN {instruction.args}\n")
            out.flush()
            started = time.monotonic()
            done = subprocess.run(
                ["/bin/sh", "-c", instruction.args],
                cwd=self.host_path(stage, self.cwd[stage]),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                check=False,
            )
        with log.open("a") as out:
            out.write(f"### took {time.monotonic() - started:.1f} s\n")
        if done.returncode != 0:
            tail = log.read_text(errors="replace")[-3000:]
            raise ReplayError(
                f"line {instruction.line}: RUN exited {done.returncode}: {instruction.args}\n{tail}"
            )

    @property
    def final(self) -> Stage:
        """The stage the image is."""
        return self.stages[-1]

    def command(self, *extra: str) -> list[str]:
        """What a container of the image runs, given `extra` arguments (`docker run IMAGE
        extra...`): ENTRYPOINT, then `extra` or else CMD."""
        (entrypoint,) = self.final.all("ENTRYPOINT")
        cmds = self.final.all("CMD")
        default = exec_form(cmds[-1]) if cmds else []
        return [*exec_form(entrypoint), *(extra or default)]

    def container_env(self, **settings: str) -> dict[str, str]:
        """The final stage's environment as a container has it (and no more of this host's
        than a shell needs), plus `settings`."""
        env = {
            k: v
            for k, v in self.host_env(self.final.name).items()
            if k in self.env[self.final.name]
        }
        env.setdefault("HOME", str(self.workdir))
        return {**env, **settings}

    def start(self, *extra: str, settings: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Start the image's command as a container would (its environment and working
        directory)."""
        stage = self.final.name
        with log.open("ab") as out:
            return subprocess.Popen(
                self.command(*extra),
                cwd=self.host_path(stage, self.cwd[stage]),
                env=self.container_env(**settings),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
