"""Stage 1: the values of a Hugging Face config, ``--hf-config FILE|org/name`` -> a dict.

Input: the path of a local config.json, or a Hub model id whose config.json is in the local
Hugging Face cache, and the ``--hf-config-kwargs`` overrides.  Output: the config's values,
which graphmem.job.load hands to the model class's ``config_class``.  The network is never
asked: nothing is ever downloaded.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

from graphmem.errors import UserInputError
from graphmem.job.fallback import first_line
from graphmem.job.option import spelling

__all__ = ["load_hf_config"]

# A Hugging Face Hub model id, ``org/name`` (huggingface_hub's repo id rules, less the ids
# without an org): one slash, no other path separator, not a file name ending in .json.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _is_hub_id(text: str) -> bool:
    return _HUB_ID.fullmatch(text) is not None and not text.lower().endswith(".json")


def _cached_hub_config(repo_id: str) -> str:
    """The path of a Hub model's config.json in the local Hugging Face cache (HF_HOME,
    HF_HUB_CACHE); the network is never asked."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as exc:
        raise UserInputError(f"{spelling('hf_config_file')} {repo_id!r}: no such file, and reading a Hub model id "
                             "needs "
                             "huggingface_hub: pip install 'graphmem[hf]'; or give a local config.json") from exc
    try:
        return str(hf_hub_download(repo_id, "config.json", local_files_only=True))
    except (OSError, ValueError) as exc:  # not cached (LocalEntryNotFoundError), a malformed id (HFValidationError)
        raise UserInputError(f"{spelling('hf_config_file')} {repo_id!r}: no such file, and the config.json of Hub "
                             f"model {repo_id!r} "
                             "is not in the Hugging Face cache (graphmem never downloads); fetch it once with "
                             f"`hf download {repo_id} config.json`, or give a local config.json") from exc


def load_hf_config(path: str | None, overrides: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The values of a local config.json, updated by ``overrides`` (None when neither is given).

    ``path`` that names no file may be a Hugging Face Hub model id (``meta-llama/Llama-3.1-8B``,
    exactly one slash, not ending in .json): its config.json is then read from the local
    Hugging Face cache only (HF_HOME, HF_HUB_CACHE); nothing is ever downloaded.

    Raises:
        UserInputError: the file is missing (and the text is no cached Hub id), unreadable or
            not a JSON object.
    """
    if path is None and not overrides:
        return None
    values: dict[str, Any] = {}
    if path is not None and not os.path.exists(path):
        if not _is_hub_id(path):
            raise UserInputError(f"{spelling('hf_config_file')}: no such file {path!r}; give a local config.json, or "
                                 "a Hub model id "
                                 "org/name whose config.json is in the Hugging Face cache")
        path = _cached_hub_config(path)
    if path is not None:
        values = _read_json_object(path)
    values.update(overrides or {})
    return values


def _read_json_object(path: str) -> dict[str, Any]:
    """The JSON object in file ``path``; UserInputError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    except json.JSONDecodeError as exc:
        raise UserInputError(f"{spelling('hf_config_file')}: {path!r} is not valid JSON: {exc}") from exc
    except OSError as exc:
        raise UserInputError(f"{spelling('hf_config_file')}: cannot read {path!r} ({exc.strerror or exc}); give a "
                             "readable "
                             "config.json") from exc
    except (RecursionError, ValueError) as exc:  # not UTF-8, nested past Python's limit, a 5,000-digit number
        what = "nested too deeply" if isinstance(exc, RecursionError) else first_line(exc)
        raise UserInputError(f"{spelling('hf_config_file')}: {path!r} is not a JSON file graphmem can read "
                             f"({what})") from exc
    if not isinstance(values, dict):
        raise UserInputError(f"{spelling('hf_config_file')}: {path!r} holds no JSON object")
    return values
