"""The runtime's own errors as API errors; the rest as the contract maps them."""
from inferd.engine.request import EngineDeadError, EngineError, GrammarError
from inferd.models.errors import ChatTemplateError
from inferd.protocol.errors import APIError, InvalidRequest, ServiceUnavailable, to_api_error


def replica_error(exc: BaseException) -> APIError:
    match exc:
        case GrammarError():
            return InvalidRequest(str(exc), param="response_format")
        case EngineError():
            return InvalidRequest(str(exc))
        case EngineDeadError():
            return ServiceUnavailable(str(exc))
        case ChatTemplateError():
            return InvalidRequest(str(exc), param="messages")
    return to_api_error(exc)
