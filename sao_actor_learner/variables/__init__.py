"""The variable server (newest policy weights, admission control, learner progress) and its
clients."""
from sao_actor_learner.variables.admission import AdmitDecision, Admission
from sao_actor_learner.variables.client import (AckInfo, AdmitResult, PublishError,
                                                VariableClient, VariableClientError,
                                                VersionInfo)
from sao_actor_learner.variables.progress import ActorAcks, Progress, make_progress
from sao_actor_learner.variables.publisher import ProgressResult, VariablePublisher
from sao_actor_learner.variables.security import (AUTH_TOKEN_ENV, AUTH_TOKEN_METADATA_KEY,
                                                  PUBLISHER_TOKEN_METADATA_KEY, PayloadRejected,
                                                  SafetensorsValidator, check_bind,
                                                  resolve_auth_token)
from sao_actor_learner.variables.server import VariableServer
from sao_actor_learner.variables.store import PublishedVersion

__all__ = [
    "AUTH_TOKEN_ENV", "AUTH_TOKEN_METADATA_KEY", "PayloadRejected", "SafetensorsValidator",
    "check_bind", "resolve_auth_token",
    "AckInfo", "ActorAcks", "AdmitDecision", "Admission", "AdmitResult", "Progress",
    "ProgressResult", "PublishError", "PublishedVersion", "PUBLISHER_TOKEN_METADATA_KEY",
    "VariableClient", "VariableClientError", "VariablePublisher", "VariableServer",
    "VersionInfo", "make_progress",
]
