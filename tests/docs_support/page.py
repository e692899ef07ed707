"""Run every fenced code block of one documentation page, top to bottom, as a reader would.

    python tests/docs_support/page.py PAGE WORKDIR CONFIG_JSON

Started by tests/test_docs.py in a fresh WORKDIR (inside a loopback-only network namespace when
the page needs a server). What runs:

- ```python blocks: executed in order in one namespace per page, like a notebook;
- ```bash blocks: each by ``bash -e -o pipefail`` in WORKDIR; a ``pip install X`` line is not
  run (nothing is downloaded) but checked: X must be installed, every extra it names declared;
- ```console blocks: each ``$ command`` is run and the lines shown under it must equal what it
  prints on stdout, with numbers and size units left out of the comparison.

Other blocks (layouts, sample messages, ini) are not run. An HTML comment right above a block
changes how it runs: ``<!-- doc-test: skip: REASON -->`` (reported), ``<!-- doc-test: gpu -->``
(without CUDA it must fail with one imgpack error line instead), ``<!-- doc-test: each
NAME=a,b,c -->`` (the block runs once per value of the variable).

CONFIG_JSON: ``{"fixtures": [...], "env": {...}, "replace": {...}}``, where ``replace`` maps text
of the page to what the test machine uses instead (a cluster's host name, say): every such change
is listed in tests/test_docs.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fixtures

FENCE = re.compile(
    r"^(?:<!-- doc-test: (?P<marker>[^\n]*?) -->\n)?```(?P<lang>[\w-]*)\n(?P<body>.*?)^```\s*$",
    re.S | re.M,
)
RUN = ("python", "bash", "console")


@dataclass
class Block:
    line: int
    lang: str
    marker: str
    body: str


def blocks(text: str) -> list[Block]:
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start("lang")) + 1
        found.append(Block(line, match["lang"], match["marker"] or "", match["body"]))
    return found


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_install(line: str, where: str) -> None:
    """``pip install ...``: every named package installed here, every imgpack extra declared."""
    for word in shlex.split(line)[2:]:
        if word.startswith("-") or word in (".", "-e"):
            continue
        name, _, extras = word.partition("[")
        if name in (".", ""):
            continue
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            raise AssertionError(
                f"{where}: `{line}` names {name}, which is not installed"
            ) from None
        declared = set(metadata.metadata(name).get_all("Provides-Extra") or [])
        for extra in filter(None, extras.rstrip("]").split(",")):
            assert extra in declared, f"{where}: {name} has no extra [{extra}]"


def run_bash(body: str, where: str, env: dict[str, str]) -> None:
    script = []
    for line in body.splitlines():
        if line.lstrip().startswith("pip install "):
            check_install(line.split("#", 1)[0].strip(), where)
            continue
        script.append(line)
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", "\n".join(script)],
        env=env,
        capture_output=True,
        text=True,
    )
    sys.stdout.write(done.stdout[-2000:])
    if done.returncode != 0:
        raise AssertionError(f"{where}: exit {done.returncode}\n{done.stderr[-4000:]}")


NUMBER = re.compile(r"\d+(?:\.\d+)?")
UNIT = re.compile(r"\b[KMGT]?i?B\b")


def normalized(line: str) -> str:
    return " ".join(UNIT.sub("B", NUMBER.sub("#", line)).split())


def run_console(body: str, where: str, env: dict[str, str]) -> None:
    steps: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
    for command, shown in steps:
        program = shlex.split(command)[0]
        if shutil.which(program, path=env.get("PATH")) is None:
            print(f"SKIP {where}: `{command}`: {program} is not installed here")
            continue
        done = subprocess.run(
            ["bash", "-c", command],  # as typed at a prompt: no pipefail (`| head`)
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise AssertionError(f"{where}: `{command}`: exit {done.returncode}\n{done.stderr}")
        if shown:
            got = [normalized(x) for x in done.stdout.splitlines() if x.strip()]
            want = [normalized(x) for x in shown if x.strip()]
            assert got == want, (
                f"{where}: `{command}` prints other lines than the page shows:\n"
                + "\n".join(done.stdout.splitlines() + done.stderr.splitlines())
            )


def run_page(page: Path, config: dict[str, object]) -> None:
    text = page.read_text()
    for old, new in dict(config.get("replace", {})).items():  # type: ignore[arg-type]
        assert old in text, f"{page}: the replaced text {old!r} is not on the page"
        text = text.replace(old, new)
    os.environ.update(dict(config.get("env", {})))  # type: ignore[arg-type]
    for name in list(config.get("fixtures", [])):  # type: ignore[call-overload]
        getattr(fixtures, name)()
    env = dict(os.environ)
    namespace: dict[str, object] = {"__name__": "__main__"}
    ran = skipped = 0
    for block in blocks(text):
        where = f"{page}:{block.line}"
        if block.lang not in RUN:
            continue
        marker = block.marker
        if marker.startswith("skip:"):
            print(f"SKIP {where}: {marker[5:].strip()}")
            skipped += 1
            continue
        runs: list[dict[str, str]] = [{}]
        if marker.startswith("each "):
            name, _, values = marker[5:].partition("=")
            runs = [{name.strip(): value} for value in values.split(",")]
        gpu_missing = marker == "gpu" and not has_cuda()
        started = time.perf_counter()
        for extra in runs:
            env_here = {**env, **extra}
            try:
                if block.lang == "python":
                    code = compile(block.body, where, "exec")
                    exec(code, namespace)
                elif block.lang == "bash":
                    run_bash(block.body, where, env_here)
                else:
                    run_console(block.body, where, env_here)
            except Exception as exc:
                if gpu_missing and type(exc).__module__.startswith("imgpack"):
                    message = str(exc)
                    assert "\n" not in message and "CUDA" in message, f"{where}: {message!r}"
                    print(f"GPU {where}: without CUDA it says: {message}")
                    continue
                traceback.print_exc()
                raise SystemExit(f"FAILED {where}: {type(exc).__name__}: {exc}") from None
            else:
                assert not gpu_missing, f"{where}: ran without CUDA, but is marked gpu"
        print(f"RAN {where} in {time.perf_counter() - started:.1f} s")
        ran += 1
    print(f"DONE {ran} block(s) of {page}, {skipped} skipped")


if __name__ == "__main__":
    page, workdir, config = Path(sys.argv[1]).resolve(), sys.argv[2], json.loads(sys.argv[3])
    os.chdir(workdir)
    sys.path.insert(0, workdir)
    run_page(page, config)
