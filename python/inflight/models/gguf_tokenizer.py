"""The tokenizer of a GGUF file, converted by transformers and cached on disk, and Gemma's chat
template for files that carry none."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from inflight.models.config import ModelConfig

logger = logging.getLogger("inflight")


# Gemma's turn format, for a Gemma GGUF that carries no chat template: a system message is
# prepended to the first user turn (Gemma has no system role), the assistant speaks as "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] + '\n\n' -%}"
    "{%- else -%}{%- set role = 'model' if m['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '') + (m['content'] | trim)"
    " + '<end_of_turn>\n' }}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


# A vocabulary smaller than this converts in well under a second: it is not cached (tests and tools that
# write many small GGUF files would otherwise fill the cache with one entry per file).
CACHE_MIN_VOCAB = 8192
_SOURCE = "inflight-source.json"  # in each cache entry: the file it was converted from


def _tokenizer_source(path: Path) -> dict[str, Any]:
    import transformers

    st = path.stat()
    return {
        "path": str(path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "transformers": transformers.__version__,
    }


def _tokenizer_cache(path: Path) -> Path:
    """Where the tokenizer transformers converts from ``path`` is kept: keyed by the file (path, size,
    modification time) and the transformers version, under ``$INFLIGHT_CACHE`` (default
    ``~/.cache/inflight``)."""
    src = _tokenizer_source(path)
    key = f"{src['path']}|{src['size']}|{src['mtime_ns']}|{src['transformers']}"
    root = Path(os.environ.get("INFLIGHT_CACHE", Path.home() / ".cache" / "inflight"))
    return root / "gguf-tokenizers" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _drop_stale_entries(cache: Path, path: Path, source_path: str) -> int:
    """Remove the other entries converted from the file at ``source_path`` (an older version of it, or
    another transformers): nothing reads them again. Returns how many went."""
    dropped = 0
    for entry in cache.parent.glob(f"{glob.escape(path.stem)}-*"):
        if entry == cache or not (entry / _SOURCE).is_file():
            continue
        try:
            if json.loads((entry / _SOURCE).read_text()).get("path") != source_path:
                continue
        except (OSError, ValueError):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        dropped += 1
    return dropped


def load_gguf_tokenizer(path: Path, config: ModelConfig | None = None):
    """The file's tokenizer, built by transformers. Converting a large vocabulary takes a while (~4 s
    for SmolLM2's 49k tokens, ~15 s for Gemma's 262k), so the result is saved once
    (:func:`_tokenizer_cache`; vocabularies of at least :data:`CACHE_MIN_VOCAB` tokens) and read back
    from there afterwards; a cache that cannot be written is skipped. Saving an entry removes the
    entries of earlier versions of the same file."""
    from transformers import AutoTokenizer

    cache = _tokenizer_cache(path)
    tok = None
    if (cache / "tokenizer.json").is_file():
        try:
            tok = AutoTokenizer.from_pretrained(str(cache))
        except (OSError, ValueError) as exc:
            logger.warning(
                "ignoring the cached tokenizer %s (%s); converting %s again", cache, exc, path.name
            )
    if tok is None:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if len(tok) >= CACHE_MIN_VOCAB:
            source = _tokenizer_source(path)
            try:
                tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=_mkdirs(cache.parent)))
                tok.save_pretrained(str(tmp))
                (tmp / _SOURCE).write_text(json.dumps(source))
                if cache.exists():  # an unreadable entry under this key
                    shutil.rmtree(cache, ignore_errors=True)
                os.replace(tmp, cache)  # atomic: a reader sees the whole tokenizer or none
                dropped = _drop_stale_entries(cache, path, source["path"])
                logger.info(
                    "tokenizer of %s cached in %s%s",
                    path.name,
                    cache,
                    f" (replacing {dropped} entries of earlier versions of the file)" if dropped else "",
                )
            except OSError as exc:
                logger.debug("could not cache the tokenizer of %s: %s", path.name, exc)
    if config is not None and config.is_gemma and not getattr(tok, "chat_template", None):
        tok.chat_template = GEMMA_CHAT_TEMPLATE
    return tok


def _mkdirs(d: Path) -> str:
    d.mkdir(parents=True, exist_ok=True)
    return str(d)
