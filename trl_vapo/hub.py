"""One question to the Hugging Face Hub before a model or a data set loads: can it be reached at all?

Offline without `HF_HUB_OFFLINE`, transformers and datasets retry for half a minute to a minute before they say so;
one request with a timeout says it at once.
"""

from __future__ import annotations

import os


def unreachable(
    repo_id: str, repo_type: str = "model", revision: str | None = None, token: str | bool | None = None
) -> Exception | None:
    """The error of the request when the Hub cannot be reached for ``repo_id`` (no network, a proxy: its class is
    the HTTP library's), else None. The Hub's own answers (`huggingface_hub.errors.HfHubHTTPError`: not found,
    gated without access, a rate limit, a server error) are raised for the caller to word or to leave to the loader.
    Only each machine's first process asks (`LOCAL_RANK` 0): a large job's ranks would hit the Hub's rate limit."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(token=token)  # (a private or gated repository's: the token the model loads with)
    try:
        info = api.repo_info(repo_id, repo_type=repo_type, revision=revision, timeout=10)
        if getattr(info, "gated", False):  # a gated repository's metadata is public, its files are not
            api.auth_check(repo_id, repo_type=repo_type)  # `GatedRepoError` without access
    except HfHubHTTPError:
        raise
    except Exception as error:
        return error
    return None
