"""Questions to the Hugging Face Hub before a model or a data set loads: can it be reached at all (offline without
`HF_HUB_OFFLINE`, transformers and datasets retry for half a minute to a minute before they say so; one request with a
timeout says it at once), and can a run push where `push_to_hub` asks it to?
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


def check_push_repository(args) -> None:
    """With `push_to_hub`, the Hub repository found or created (what transformers' `Trainer.init_hf_repo` does,
    `exist_ok`) before any model loads: without a token, offline, or without write access to `hub_model_id`, the
    Trainer failed there after the policy, its critic and the reward models had loaded (minutes for a large one).
    The world's first process asks, as in transformers."""
    if not args.push_to_hub or args.process_index != 0:
        return
    from pathlib import Path

    import transformers.trainer

    name = args.hub_model_id or Path(args.output_dir).absolute().name  # (transformers' default name)
    try:
        transformers.trainer.hf_api().create_repo(
            name, token=args.hub_token, private=args.hub_private_repo, exist_ok=True
        )
    except Exception as error:  # the HTTP library's (no network), huggingface_hub's (offline, no token, forbidden)
        reason = " ".join(str(error).split()).rstrip(".") or type(error).__name__
        raise ValueError(
            f"push_to_hub=True, and the Hub repository {name!r} could not be created or found: {reason}. Log in "
            "with write access (`hf auth login`, or `hub_token`), name a repository you may write to "
            "(`hub_model_id`), or leave push_to_hub unset and push the saved folder later."
        ) from error
