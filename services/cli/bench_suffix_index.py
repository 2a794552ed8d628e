"""`mirror-sd bench --suffix-index`: our suffix index against arctic-inference's suffix tree
(services/bench/suffix_index.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from services.cli.common import fail
from services.errors import MirrorSDError

logger = logging.getLogger(__name__)


def bench_suffix_index(*, index_tokens: str | None, seed: int, out: str) -> None:
    """Checks the sizes, tokenizes the prompt sets with the built-in tokenizer, runs the bench, writes its report."""
    from services.bench.suffix_corpus import build_corpus, load_turns
    from services.bench.suffix_index import DEFAULT_INDEX_TOKENS, SuffixBenchConfig, parse_index_tokens
    from services.bench.suffix_index import run_suffix_index_bench
    from services.bench.suffix_index_report import meta, write_json, write_markdown
    from services.config import get_settings
    from services.models.builtin import BUILTIN_MODELS
    from services.models.locate import resolve_model_dir
    from services.models.tokenization import encode_prompt
    from services.models.tokenizer_loading import load_tokenizer

    try:
        config = SuffixBenchConfig(index_tokens=parse_index_tokens(index_tokens or DEFAULT_INDEX_TOKENS), seed=seed)
    except ValueError as exc:
        fail(str(exc))
    builtin = next(iter(BUILTIN_MODELS))  # the built-in tokenizer, whatever target the settings name
    try:
        tokenizer = load_tokenizer(resolve_model_dir(builtin, get_settings().cache_dir)[1])
    except MirrorSDError as exc:
        fail(str(exc))
    corpus = build_corpus(load_turns(), lambda text: encode_prompt(tokenizer, text, chat=True),
                          lambda text: encode_prompt(tokenizer, text, chat=False), len(tokenizer), seed)
    info = meta(config, corpus, builtin)
    try:
        rows = run_suffix_index_bench(config, corpus, progress=lambda line: typer.echo(line, err=True))
    except (ValueError, RuntimeError) as exc:
        fail(str(exc))
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    files = [write_json(folder / "suffix_index.json", info, rows),
             write_markdown(folder / "suffix_index.md", info, rows)]
    typer.echo(files[1].read_text())
    typer.echo("wrote " + ", ".join(str(path) for path in files))
