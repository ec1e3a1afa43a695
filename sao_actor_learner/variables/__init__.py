"""The variable server (newest policy weights, admission control) and its clients."""
from sao_actor_learner.variables.client import (AdmitResult, PublishError, VariableClient,
                                                VariableClientError, VariablePublisher,
                                                VersionInfo)
from sao_actor_learner.variables.security import (AUTH_TOKEN_ENV, AUTH_TOKEN_METADATA_KEY,
                                                  PayloadRejected, SafetensorsValidator,
                                                  check_bind, resolve_auth_token)
from sao_actor_learner.variables.server import (PUBLISHER_TOKEN_METADATA_KEY, PublishedVersion,
                                                VariableServer)

__all__ = [
    "AUTH_TOKEN_ENV", "AUTH_TOKEN_METADATA_KEY", "PayloadRejected", "SafetensorsValidator",
    "check_bind", "resolve_auth_token",
    "AdmitResult", "PublishError", "PublishedVersion", "PUBLISHER_TOKEN_METADATA_KEY",
    "VariableClient", "VariableClientError", "VariablePublisher", "VariableServer",
    "VersionInfo",
]
