"""A fresh clone has everything it needs: the dev prompt set ships inside, and nothing points outside the repo.

Nothing here may skip: a test that skips for a missing file hides the very breakage these tests exist for.
"""

from __future__ import annotations

import json
import subprocess

from typer.main import get_command

from services.bench.prompts import DEV_PROMPTS_PATH, REPEATED_WORK_PATH, load_prompts
from tests.conftest import REPO_ROOT

# Spelled in pieces, so that this file does not match itself.
OUTSIDE_REFERENCES = (".." + "/shared", 'parent / "' + 'shared"')
CHECKED = ("README.md", "Makefile", "pyproject.toml", ".ci", "compose", "data", "docs", "tests", "services",
           "gateway", "draft_worker", "verify_worker", "telemetry")
BINARY_SUFFIXES = (".png", ".safetensors", ".whl", ".gguf", ".pyc")
# Data, not instructions: a bench's results.json records the prompt path of its day, as it was run.
RECORD_SUFFIXES = (".json", ".jsonl")


def test_dev_prompts_ship_in_the_repository_and_parse():
    assert DEV_PROMPTS_PATH.is_relative_to(REPO_ROOT), DEV_PROMPTS_PATH
    assert DEV_PROMPTS_PATH.is_file(), f"{DEV_PROMPTS_PATH} is missing (see data/README.md)"
    records = [json.loads(line) for line in DEV_PROMPTS_PATH.read_text().splitlines() if line.strip()]
    assert len(records) == 283
    for record in records:
        assert {"id", "category", "prompt"} <= set(record), record.get("id")
        assert isinstance(record["prompt"], str) and record["prompt"], record["id"]
    assert len({record["id"] for record in records}) == len(records)
    assert len(load_prompts(DEV_PROMPTS_PATH)) == 283  # and the bench's reader takes it as it is


def test_the_repeated_work_set_ships_and_each_record_is_well_formed():
    records = [json.loads(line) for line in REPEATED_WORK_PATH.read_text().splitlines() if line.strip()]
    assert 30 <= len(records) <= 48 and len({record["id"] for record in records}) == len(records)
    schemas = set()
    for record in records:
        assert set(record) == {"id", "category", "turns", "context_chars", "source"}, record.get("id")
        turns, category = record["turns"], record["category"]
        assert isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns), record["id"]
        assert category in ("rework", "extraction_schema", "code_edit"), record["id"]
        assert len(turns) >= (1 if category == "extraction_schema" else 2), record["id"]  # later turns rework
        assert any(licence in record["source"] for licence in ("Apache-2.0", "CC BY-SA 4.0", "MIT")), record["id"]
        assert 0 <= record["context_chars"] <= len(turns[0]), record["id"]
        if category == "extraction_schema":  # one instruction and schema, a different document each time
            instruction, document = turns[0].split("Document:\n")
            schemas.add(instruction)
            assert 100 <= len(document.split()) <= 400 and record["context_chars"] == len(document), record["id"]
    assert len(schemas) == 1
    assert sum(record["category"] == "extraction_schema" for record in records) >= 10
    prompts = load_prompts(REPEATED_WORK_PATH)  # the bench reads every turn, in order
    assert [list(prompt.turns) for prompt in prompts] == [record["turns"] for record in records]
    assert [prompt.id for prompt in prompts] == [record["id"] for record in records]


def test_bench_defaults_to_the_repository_prompt_set():
    from services.cli import app

    bench = get_command(app).commands["bench"]
    default = next(param.default for param in bench.params if param.name == "prompts")
    assert default == str(DEV_PROMPTS_PATH)


def _text_files() -> list:
    """The files under CHECKED that git tracks or would (every file there when this is not a git checkout)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *CHECKED],
                            cwd=REPO_ROOT, capture_output=True)
    if listed.returncode == 0 and listed.stdout:
        paths = [REPO_ROOT / name for name in listed.stdout.decode().split("\0") if name]
    else:
        paths = [path for name in CHECKED for path in ([REPO_ROOT / name] + list((REPO_ROOT / name).rglob("*")))
                 if "__pycache__" not in path.parts]
    return [path for path in paths if path.is_file() and path.suffix not in BINARY_SUFFIXES + RECORD_SUFFIXES]


def test_nothing_refers_outside_the_repository():
    offenders = []
    for path in _text_files():
        data = path.read_bytes()
        if b"\0" in data:
            continue
        for number, line in enumerate(data.decode(errors="replace").splitlines(), start=1):
            if any(needle in line for needle in OUTSIDE_REFERENCES):
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    assert not offenders, "references outside the repository:\n" + "\n".join(offenders)
