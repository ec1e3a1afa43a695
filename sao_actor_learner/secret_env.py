"""The environment variables that hold a run's secrets, and an environment without them.

A launch reads its secrets from the environment (credentials.py; `--auth_token` is put there
too) and its nodes inherit that environment. Subprocesses that run code which is not this
project's (reward workers, which import user reward functions; the vLLM server) get the
environment less these variables: they need none of them.

Standard library only.
"""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional

AUTH_TOKEN_ENV = "SAO_AUTH_TOKEN"            # as variables/security.AUTH_TOKEN_ENV
LEARNER_TOKEN_ENV = "SAO_LEARNER_TOKEN"
ROLLOUT_SECRET_ENV = "SAO_ROLLOUT_SECRET"
SECRET_ENV_VARS = (AUTH_TOKEN_ENV, LEARNER_TOKEN_ENV, ROLLOUT_SECRET_ENV)


def without_secrets(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """A copy of `environ` (default: os.environ) without SECRET_ENV_VARS."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k not in SECRET_ENV_VARS}
